"""A runtime that cannot take the best result so far (OpenVINO after bladesmith's Winograd
kernel was kept: its converter has no rule for that operator) is tried on the latest kept
result it can take and timed against the best: the fastest runtime wins, the passes it
leaves out say they were superseded, and a slower one leaves the best as it was."""

from __future__ import annotations

import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes import Candidate, Context, Pass, PassSkipped
from bladesmith.runtimes.torchscript import SUFFIX as TORCHSCRIPT_SUFFIX
from engine_testing import Wasteful

QUICK = Config(warmup=1, iters=6, progress=False)


class Unwrap(Pass):
    """Removes one ``Wasteful`` (work a pass removes, a large gain whatever the load of
    the machine); its result stands for one that brings in an operator the runtime below
    has no rule for."""

    name = "test_unwrap"
    devices = ("cpu",)
    changes_arithmetic = False

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        return candidate.with_module(candidate.module.inner, self.name)


class Runtime(Pass):
    """A runtime that takes no result of ``test_unwrap``; it runs the model without any
    waste (``faster``) or with more."""

    name = "test_runtime"
    devices = ("cpu",)
    changes_arithmetic = False
    saves_as = TORCHSCRIPT_SUFFIX

    def __init__(self, faster: bool = True):
        self.faster = faster

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if Unwrap.name in candidate.applied:
            return "it has no rule for what test_unwrap brought in"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        inner = candidate.module
        while isinstance(inner, Wasteful):
            inner = inner.inner
        slower = Wasteful(Wasteful(candidate.module))
        return candidate.with_runner(inner if self.faster else slower, self.name)


class SkipsOnceApplied(Pass):
    """A runtime that takes every result and finds out only once applied that it does
    not apply (a dependency missing, nothing for it to do)."""

    name = "test_skips_once_applied"
    devices = ("cpu",)
    saves_as = TORCHSCRIPT_SUFFIX

    def __init__(self):
        self.applied = 0

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        self.applied += 1
        raise PassSkipped("nothing to do here")


def _optimized(runtime: Pass):
    torch.manual_seed(0)
    model = Wasteful(Wasteful(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))).eval()
    x = torch.rand(1, 3, 16, 16)
    optimized, spec, report = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=QUICK, passes=[Unwrap(), runtime]
    )
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    return spec, {record.name: record for record in report.optimizations}


def test_a_runtime_refused_by_the_best_runs_the_result_before_it_and_wins():
    spec, records = _optimized(Runtime(faster=True))
    assert records["test_unwrap"].status == "kept", records["test_unwrap"].reason
    assert records["test_runtime"].status == "kept", records["test_runtime"].reason
    assert records["test_runtime"].reason.startswith(
        "tried on the result without test_unwrap (the best so far: it has no rule for what "
        "test_unwrap brought in): "
    )
    assert spec.backend == "test_runtime" and spec.passes == ("test_runtime",)
    assert records["test_unwrap"].reason.endswith("superseded by test_runtime")


def test_a_slower_runtime_on_an_earlier_result_leaves_the_best():
    spec, records = _optimized(Runtime(faster=False))
    assert records["test_unwrap"].status == "kept", records["test_unwrap"].reason
    assert records["test_runtime"].status == "rejected"
    assert records["test_runtime"].reason.startswith("tried on the result without test_unwrap")
    assert spec.passes == ("test_unwrap",)


def test_a_runtime_that_skips_once_applied_is_not_applied_again_to_an_earlier_result():
    runtime = SkipsOnceApplied()
    _, records = _optimized(runtime)
    assert runtime.applied == 1
    assert records["test_skips_once_applied"].reason == "nothing to do here"
