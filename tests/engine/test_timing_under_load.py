"""optimize's timing on a busy machine: a pass that changes nothing, timed while other
processes burn every core, shows a speedup whose interval holds 1.0, and is not kept."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes import Pass


class Identity(Pass):
    """Changes nothing: any speedup it shows is the clock's noise."""

    name = "identity"

    def apply(self, candidate, context):
        return candidate.with_module(candidate.module, self.name)


def test_a_pass_that_changes_nothing_is_not_kept_under_load():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3))
    x = torch.randn(1, 3, 64, 64)
    burn = [sys.executable, "-c", "while True: pass"]
    burners = [subprocess.Popen(burn) for _ in range(os.cpu_count() or 1)]
    try:
        _, _, report = bladesmith.optimize(
            model,
            device="cpu",
            test_data=[(x,)],
            config=Config(warmup=2, iters=20),
            passes=[Identity()],
        )
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    [record] = report.optimizations
    low, high = record.interval
    assert low <= 1.0 <= high, record
    assert record.status == "rejected", record
    assert "below" in record.reason or "interval" in record.reason
    # Nothing kept: the result is the model's own call path, timed as such.
    assert report.overall["speedup"] == 1.0
