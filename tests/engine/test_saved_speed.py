"""The report's speedup of the artifact: the result as save writes it, reloaded in a new
process and timed there alone, beside the in-process figure."""

from __future__ import annotations

import time

import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes import Pass
from engine_testing import Memoized

QUICK = Config(warmup=1, iters=6, min_speedup=1e-6, progress=False)
DELAY_S = 0.02


class Sleepy(nn.Module):
    """A Linear layer that sleeps ``delay`` seconds per call (eager only: a trace keeps
    the layer and drops the sleep)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.delay = DELAY_S

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return self.linear(x)


class Awake(Pass):
    """The model without its sleep: faster in process and as saved."""

    name = "awake"

    def apply(self, candidate, context):
        import copy

        module = copy.deepcopy(candidate.module)
        module.delay = 0.0
        return candidate.with_module(module, self.name)


def test_the_saved_figure_is_measured_on_the_reloaded_artifact():
    x = torch.randn(2, 4)
    _, spec, report = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[x], config=QUICK, passes=[Awake()]
    )
    saved = report.overall["saved"]
    assert saved["measured"] and saved["format"] == spec.save_formats[0] == ".pt"
    assert saved["ratio"] > 5  # 20 ms of sleep against a Linear layer
    assert "reloaded in a new process" in report.diagnosis["message"]


def test_a_runner_that_lives_only_in_process_does_not_lend_its_speed_to_the_file():
    # Memoized answers the timed input from memory, in this process only; the file holds
    # the convolutions, which compute as the model as given does: the saved figure is
    # the file's, the in-process one stays beside it, far above.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.Flatten(0)
    ).eval()
    _, spec, report = bladesmith.optimize(
        model, device="cpu", test_data=[torch.rand(1, 3, 96, 96)], config=QUICK, passes=[Memoized()]
    )
    saved, overall = report.overall["saved"], report.overall
    assert spec.passes == ("memoized",) and saved["measured"] and saved["format"] == ".pt"
    assert overall["speedup"] > 3 * saved["ratio"], (overall["speedup"], saved["ratio"])
    assert report.saved == saved


def test_the_model_as_given_is_not_timed_again_as_saved():
    _, _, report = bladesmith.optimize(
        nn.Linear(4, 3).eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[]
    )
    assert report.overall["saved"] == {
        "format": None,
        "measured": False,
        "why": "the result is the model as given",
    }
