"""The report's speedup of the artifact: the result as save writes it, reloaded in new
processes and timed there in turn with the model as given, beside the in-process figure."""

from __future__ import annotations

import io
import time

import pytest
import torch
from rich.console import Console
from torch import nn

import bladesmith
from bladesmith.bench import Speedup
from bladesmith.config import Config
from bladesmith.engine.result import format_losses, headline
from bladesmith.engine.saved_speed import SavedSpeed
from bladesmith.passes import Pass
from bladesmith.passes.winograd import Winograd
from bladesmith.runtimes.formats import FORMATS
from bladesmith.spec import Spec
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


def measured(saved: dict) -> dict:
    """``saved`` (the report's saved figure) when it was measured; the test is skipped,
    saying so, when the machine was too loaded to measure it (no figure to decide on)."""
    if not saved["measured"] and "too loaded to measure" in saved.get("why", ""):
        pytest.skip(f"saved speed: {saved['why']}")
    return saved


def test_the_saved_figure_is_measured_on_the_reloaded_artifact():
    x = torch.randn(2, 4)
    _, spec, report = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[x], config=QUICK, passes=[Awake()]
    )
    saved = measured(report.overall["saved"])
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
    saved, overall = measured(report.overall["saved"]), report.overall
    assert spec.passes == ("memoized",) and saved["measured"] and saved["format"] == ".pt"
    assert overall["speedup"] > 3 * saved["ratio"], (overall["speedup"], saved["ratio"])
    assert report.saved == saved
    # No pass declares the loss (Pass.lost_in): the figures say it.
    assert (saved["high"] < overall["interval"][0]) == (
        "part of the gain lives only in this process" in report.diagnosis["message"]
    )


def test_the_model_as_given_is_not_timed_again_as_saved():
    _, _, report = bladesmith.optimize(
        nn.Linear(4, 3).eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[]
    )
    assert report.overall["saved"] == {
        "format": None,
        "measured": False,
        "why": "the result is the model as given",
    }


LOGGED_ROUNDS = """
import os, time
from bladesmith import bench
_time_round = bench.time_round
def _logged(*args, **kwargs):
    start = time.time()
    samples = _time_round(*args, **kwargs)
    with open(os.environ["SAVED_ROUNDS_LOG"], "a") as log:
        log.write(f"{start} {time.time()} {os.getpid()}\\n")
    return samples
bench.time_round = _logged
"""


def timed_with_a_log(tmp_path, monkeypatch, iters: int, rounds: int):
    """saved_speed of Sleepy without its sleep against Sleepy: the result, the file's
    rounds (start, end, process id) as the new processes logged them, and the model as
    given's calls (start, end)."""
    from bladesmith.engine import saved_speed

    x = torch.randn(2, 4)
    optimized, spec, _ = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[x], config=QUICK, passes=[Awake()]
    )
    log = tmp_path / "saved_rounds.log"
    monkeypatch.setenv("SAVED_ROUNDS_LOG", str(log))
    monkeypatch.setattr(saved_speed, "_CHILD", LOGGED_ROUNDS + saved_speed._CHILD)
    given_calls, model = [], Sleepy().eval()

    def given(*args):
        start = time.time()
        model(*args)
        given_calls.append((start, time.time()))

    result = saved_speed.saved_speed(
        optimized,
        spec.save_formats,
        given,
        (x,),
        warmup=1,
        iters=iters,
        rounds=rounds,
        batch_size=2,
        device="cpu",
    )
    logged = [line.split() for line in log.read_text().splitlines()]
    return result, [(float(a), float(b), int(pid)) for a, b, pid in logged], given_calls


def test_the_saved_file_and_the_model_as_given_take_turns_round_by_round(tmp_path, monkeypatch):
    # A change of load between a phase of the model as given and the file's phase would
    # read as speedup: their rounds alternate, never overlapping, as compare's do.
    result, saved_rounds, given_calls = timed_with_a_log(tmp_path, monkeypatch, 8, 4)
    assert result.speedup is not None and len(result.speedup.round_ratios) == 4
    assert len(saved_rounds) == 5  # the warm-up, then a round of each of the 4
    assert len({pid for *_, pid in saved_rounds}) == 1  # 4 rounds: too few to share
    events = sorted(
        [(a, b, "given") for a, b in given_calls] + [(a, b, "saved") for a, b, _ in saved_rounds]
    )
    for before, after in zip(events, events[1:]):
        assert before[1] <= after[0], "the two sides ran at once"
    turns = [
        which
        for index, (*_, which) in enumerate(events)
        if index == 0 or events[index - 1][2] != which
    ]
    # warm-ups G, S; then rounds G/S, S/G, G/S, S/G
    assert turns == ["given", "saved", "given", "saved", "given", "saved", "given"], turns


def test_ten_rounds_are_shared_between_two_new_processes(tmp_path, monkeypatch):
    # One process can run the file 10-40% apart from the next: the interval holds both.
    result, saved_rounds, _ = timed_with_a_log(tmp_path, monkeypatch, 10, 10)
    assert result.speedup is not None and len(result.speedup.round_ratios) == 10
    first, second = sorted(
        {pid for *_, pid in saved_rounds}, key=[p for *_, p in saved_rounds].index
    )
    assert [pid for *_, pid in saved_rounds] == [first] * 6 + [second] * 6  # warm-up + 5 each


def test_a_saved_file_whose_process_dies_is_not_measured_and_says_why(monkeypatch):
    from bladesmith.engine import saved_speed

    monkeypatch.setattr(saved_speed, "_CHILD", "import os\nnext(requests())\nos.abort()")
    _, _, report = bladesmith.optimize(
        Sleepy().eval(),
        device="cpu",
        test_data=[torch.randn(2, 4)],
        config=QUICK,
        passes=[Awake()],
    )
    saved = report.overall["saved"]
    assert saved["measured"] is False and "killed by SIGABRT" in saved["why"], saved


GIVEN_LOGGED = """
import os
with open(os.environ["GIVEN_PROCESS_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
"""


def test_the_model_as_given_is_timed_in_a_new_process_of_its_own(tmp_path, monkeypatch):
    # Both sides fresh: the model as given is rebuilt (pickled, its class importable)
    # in a process beside the file's, not timed warm in the optimizing one.
    import os

    from bladesmith.engine import saved_speed

    log = tmp_path / "given.log"
    monkeypatch.setenv("GIVEN_PROCESS_LOG", str(log))
    monkeypatch.setattr(saved_speed, "_GIVEN_CHILD", saved_speed._GIVEN_CHILD + GIVEN_LOGGED)
    _, _, report = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[Awake()]
    )
    saved = report.overall["saved"]
    assert saved["given"] == "in a new process of its own", saved
    pids = log.read_text().split()
    assert len(pids) == 1 and int(pids[0]) != os.getpid()
    if saved["measured"]:
        assert "the model as given timed in a new process of its own" in report.diagnosis["message"]


def test_a_model_that_cannot_go_to_a_new_process_is_timed_here_and_says_why():
    class Local(Sleepy):  # defined inside a function: no new process can import it
        pass

    _, _, report = bladesmith.optimize(
        Local().eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[Awake()]
    )
    saved = report.overall["saved"]
    assert saved["given"].startswith("in this process, as it cannot be rebuilt in a new one")
    assert "Local" in saved["given"] and "inside a function" in saved["given"]


def test_a_torchscript_model_as_given_goes_to_its_process_as_itself(tmp_path):
    from bladesmith.engine.saved_speed import given_file

    scripted = torch.jit.script(nn.Linear(4, 3))
    path, why = given_file(scripted, tmp_path)
    assert why == "" and path.suffix == ".pt"
    x = torch.randn(2, 4)
    assert torch.equal(torch.jit.load(str(path))(x), scripted(x))


def test_rounds_too_far_apart_are_said_to_be_no_figure(monkeypatch):
    # A loaded machine: the file's rounds range over 8 times; no interval is printed as
    # a result, the report says the machine was too loaded.
    from bladesmith.engine import saved_speed

    def loaded(given, given_path, path, args, sizes, warmup):
        given_rounds = [([10.0] * size, [10.0] * size) for size in sizes]
        saved_rounds = [([1.0 + 7.0 * (i % 2)] * s, [1.0] * s) for i, s in enumerate(sizes)]
        return given_rounds, saved_rounds

    monkeypatch.setattr(saved_speed, "_in_turn", loaded)
    _, _, report = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[Awake()]
    )
    saved = report.overall["saved"]
    assert saved["measured"] is False and "too loaded to measure" in saved["why"], saved
    assert "saved: not measured (the machine was too loaded" in report.diagnosis["message"]


def test_rounds_that_agree_are_a_figure(monkeypatch):
    from bladesmith.engine import saved_speed

    def quiet(given, given_path, path, args, sizes, warmup):
        return [([10.0] * s, [10.0] * s) for s in sizes], [([5.0] * s, [5.0] * s) for s in sizes]

    monkeypatch.setattr(saved_speed, "_in_turn", quiet)
    _, _, report = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[Awake()]
    )
    saved = report.overall["saved"]
    assert saved["measured"] and saved["ratio"] == 2.0, saved


def test_the_headline_is_the_artifacts_figure_then_the_in_process_one():
    _, _, report = bladesmith.optimize(
        Sleepy().eval(), device="cpu", test_data=[torch.randn(2, 4)], config=QUICK, passes=[Awake()]
    )
    first, *_ = report.diagnosis["message"].splitlines()
    saved = report.overall["saved"]
    if saved["measured"]:
        assert first.startswith("The artifact, saved as .pt and reloaded in a new process: ")
        assert f"{saved['ratio']:.2f}x" in first.split("in this process")[0]
    else:  # too loaded to measure: said first, all the same
        assert first.startswith("The artifact: saved: not measured ("), first
    assert first.index("in this process") > first.index("The artifact")
    console = Console(file=io.StringIO(), width=200)
    report.render(console)
    shown = console.file.getvalue()
    assert shown.index("The artifact") < shown.index("In this process")


class MemoizedHere(Memoized):
    """Memoized, declaring what it is: its gain lives in this process, in no file."""

    name = "memoized_here"
    lost_in = dict.fromkeys(FORMATS, "its memory of the outputs stays in this process")


def test_a_format_that_loses_a_passs_gain_says_so_in_words():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.Flatten(0)
    ).eval()
    _, spec, report = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[torch.rand(1, 3, 96, 96)],
        config=QUICK,
        passes=[MemoizedHere()],
    )
    lines = report.diagnosis["message"].splitlines()
    assert lines[0].startswith("The artifact"), lines
    assert lines[1].startswith(
        "Saved as .pt, the artifact loses the gain of memoized_here (memoized_here: its "
        "memory of the outputs stays in this process)"
    ), lines
    assert lines[1].endswith("; no format keeps it."), lines
    if report.overall["saved"]["measured"]:
        assert " saved against " in lines[1] and " in this process; " in lines[1]


LOST_IN = {"winograd": Winograd.lost_in}


def _figure(ratio: float) -> Speedup:
    return Speedup(ratio, ratio * 0.95, ratio * 1.05, 0.95, (), None, None)


@pytest.mark.parametrize(
    ("saved_formats", "keeps"),
    [
        ((".onnx", ".pt"), '.pt keeps it: save as .pt (bladesmith.save(optimized, "model.pt")'),
        ((".onnx",), "the format that would keep it, .pt, refused here (it does not trace)"),
    ],
)
def test_the_format_that_keeps_a_lost_gain_is_named(saved_formats, keeps):
    # Keypoint R-CNN on a CPU: winograd kept, .onnx the artifact, which holds the plain
    # convolutions: 0.97x saved against 1.23x in process.
    spec = Spec(
        device="cpu",
        dtype="float32",
        input_shapes=((1, 3, 8, 8),),
        output="detections",
        passes=("fixed_shape", "winograd"),
        backend="eager",
        save_formats=saved_formats,
        refused_formats={} if ".pt" in saved_formats else {".pt": "it does not trace"},
    )
    line = format_losses(spec, _figure(1.23), SavedSpeed(".onnx", _figure(0.97)), LOST_IN)
    assert line.startswith("Saved as .onnx, the artifact loses the gain of winograd (winograd: ")
    assert ": 0.97x [0.92-1.02] saved against 1.23x [1.17-1.29] in this process; " in line
    assert keeps in line, line


def test_a_format_that_keeps_every_gain_says_nothing():
    spec = Spec(
        device="cpu",
        dtype="float32",
        input_shapes=((1, 3, 8, 8),),
        output="detections",
        passes=("winograd",),
        backend="eager",
        save_formats=(".pt",),
    )
    assert format_losses(spec, _figure(1.23), SavedSpeed(".pt", _figure(1.2)), LOST_IN) == ""


def test_a_result_that_saves_in_no_format_says_so_first():
    spec = Spec(
        device="cpu",
        dtype="float32",
        input_shapes=((1, 3, 8, 8),),
        output="detections",
        passes=("norm_folding",),
        backend="eager",
        save_formats=(),
        untried_formats={".pt2": "not tried during optimize"},
        refused_formats={".pt": "it does not trace", ".onnx": "its outputs moved"},
    )
    line = headline(spec, _figure(1.2), SavedSpeed(None, None, "no format it saves in was tried"))
    assert line == (
        "NOTHING SAVES: no format saved and loaded back with the model's outputs, so no "
        "checked file keeps this result (in this process 1.20x [1.14-1.26]): .pt: it does "
        "not trace; .onnx: its outputs moved; untried: .pt2 (bladesmith.save builds it and "
        "checks it)."
    )
