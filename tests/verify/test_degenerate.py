"""Verification that cannot pass on nothing: NaN or inf inputs and reference outputs, no
outputs, all-zero outputs and detectors that detect nothing are diagnosed, and keep no
pass without the user's consent (``Config(allow_degenerate=True)``)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes import Pass
from bladesmith.verify import compare_outputs, degenerate_reasons

QUICK = Config(warmup=0, iters=3)


def no_detections():
    return [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0)}]


@pytest.mark.parametrize(
    ("reference", "inputs", "says"),
    [
        (torch.full((4,), float("nan")), None, "4 of 4 reference output values are NaN or inf"),
        (torch.tensor([1.0, float("inf")]), None, "1 of 2 reference output values"),
        (torch.ones(3), (torch.tensor([float("nan"), 1.0]),), "1 of 2 input values are NaN"),
        ((torch.zeros(2, 3), {"x": torch.zeros(0)}), None, "every reference output is empty"),
        (no_detections(), None, "no detection"),
        ((None, "text"), None, "returns no tensor and no detection"),
    ],
    ids=["nan-output", "inf-output", "nan-input", "zero-and-empty", "no-detections", "none"],
)
def test_a_comparison_on_nothing_is_diagnosed_and_fails(reference, inputs, says):
    comparison = compare_outputs(reference, reference, inputs=inputs)
    assert not comparison.passed
    assert any(says in reason for reason in comparison.degenerate), comparison.degenerate
    assert comparison.summary().startswith("nothing to compare (")
    assert "allow_degenerate=True" in comparison.summary()
    consented = compare_outputs(reference, reference, inputs=inputs, allow_degenerate=True)
    assert consented.passed
    assert consented.summary().startswith("accepted with nothing to compare")
    assert consented.to_dict()["degenerate"] == comparison.degenerate


def test_outputs_that_hold_something_are_not_degenerate():
    detections = [{"boxes": torch.ones(1, 4), "scores": torch.ones(1), "labels": torch.ones(1)}]
    assert degenerate_reasons((torch.zeros(3), torch.ones(2))) == []  # one output holds values
    assert degenerate_reasons(detections, (torch.ones(2),)) == []


class Slow(nn.Module):
    def __init__(self, delay=0.02):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return self.linear(x)


class Faster(Pass):
    name = "faster"

    def apply(self, candidate, context):
        module = Slow(delay=0.0)
        module.load_state_dict(candidate.module.state_dict())
        return candidate.with_module(module, self.name)


def test_optimize_keeps_nothing_on_nan_inputs_without_consent():
    data = [(torch.full((2, 4), float("nan")),)]
    _, spec, report = bladesmith.optimize(
        Slow(), device="cpu", test_data=data, config=QUICK, passes=[Faster()]
    )
    [record] = report.optimizations
    assert record.status == "rejected" and "nothing to compare" in record.reason
    assert "allow_degenerate=True" in record.reason
    assert spec.passes == ()
    assert (
        "Verification has nothing to compare: 8 of 8 input values" in (report.diagnosis["message"])
    )
    assert not report.accuracy["passed"]

    _, spec, report = bladesmith.optimize(
        Slow(),
        device="cpu",
        test_data=data,
        config=QUICK.replace(allow_degenerate=True),
        passes=[Faster()],
    )
    assert spec.passes == ("faster",)
    assert (
        report.accuracy["passed"]
        and "as Config(allow_degenerate=True) asks" in (report.diagnosis["message"])
    )


class Detects(nn.Module):
    """A detector that finds nothing: every score under its threshold."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 10)

    def forward(self, x):
        scores = torch.sigmoid(self.linear(x)[0]) * 0.0
        keep = scores > 0.5
        boxes = torch.arange(40.0).reshape(10, 4)
        return [{"boxes": boxes[keep], "scores": scores[keep], "labels": torch.ones(10)[keep]}]


def test_a_detector_that_detects_nothing_keeps_no_pass():
    class Same(Pass):
        name = "same"

        def apply(self, candidate, context):
            return candidate.with_module(candidate.module, self.name)

    _, spec, report = bladesmith.optimize(
        Detects(), device="cpu", test_data=[(torch.ones(1, 2),)], config=QUICK, passes=[Same()]
    )
    [record] = report.optimizations
    assert record.status == "rejected" and "no detection" in record.reason
    assert spec.passes == ()
