"""verify.outputs: any structure of outputs, compared by path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verify_testing import make_detections, one_image, strict_json, take

from bladesmith.verify import (
    Comparison,
    Tolerance,
    compare_outputs,
)


def test_nested_structures_are_compared_by_path():
    reference = (torch.ones(3), {"boxes": torch.zeros(2, 4), "labels": torch.arange(2)})
    candidate = (torch.ones(3), {"boxes": torch.zeros(2, 4) + 1, "labels": torch.arange(2)})
    result = compare_outputs(reference, candidate)
    assert isinstance(result, Comparison)
    assert list(result.outputs) == ["out[0]", "out[1]['boxes']", "out[1]['labels']"]
    assert not result.passed
    assert result.summary().startswith("out[1]['boxes']: max abs 1")
    data = result.to_dict()
    assert data["outputs"]["out[1]['labels']"]["passed"] is True
    strict_json(data)


def test_detection_lists_inside_structures_use_detection_matching():
    detections = [make_detections(seed=5)]
    shuffled = [take(detections[0], torch.randperm(50))]
    result = compare_outputs((detections, torch.ones(2)), (shuffled, torch.ones(2)))
    assert result.passed, result.summary()
    assert result.outputs["out[0]"].to_dict()["kind"] == "detections"
    assert result.summary().startswith("all 2 outputs within tolerance")


def test_structure_mismatches_fail_with_reasons():
    cases = [
        ((torch.ones(1), torch.ones(1)), (torch.ones(1),), "out: 1 items, the reference has 2"),
        ({"a": torch.ones(1)}, {"b": torch.ones(1)}, "keys ['b'] differ"),
        ({"a": torch.ones(1)}, [torch.ones(1)], "out: expected a dict, got list"),
        ([torch.ones(1)], torch.ones(1), "out: expected a sequence, got Tensor"),
        ((torch.ones(1),), ("x",), "out[0]: expected a tensor, got str"),
        ((None, "a"), (None, "b"), "out[1]: 'b' differs"),
    ]
    for reference, candidate, reason in cases:
        result = compare_outputs(reference, candidate)
        assert not result.passed
        assert reason in result.summary()
        assert result.tolerance_ratio == math.inf


def test_numbers_and_arrays_are_compared_as_tensors():
    result = compare_outputs({"n": 3, "x": np.ones(2)}, {"n": 3, "x": np.ones(2)})
    assert result.passed and len(result.outputs) == 2
    with pytest.raises(TypeError, match="cannot compare outputs of type object"):
        compare_outputs(object(), object())


def test_per_output_tolerance_overrides():
    reference = (torch.ones(4), {"logits": torch.ones(4)})
    candidate = (torch.ones(4) * 1.01, {"logits": torch.ones(4) * 1.01})
    assert not compare_outputs(reference, candidate).passed
    assert not compare_outputs(reference, candidate, tolerances={0: Tolerance(rtol=0.05)}).passed
    by_key = compare_outputs(
        reference,
        candidate,
        tolerances={0: Tolerance(rtol=0.05), "logits": Tolerance(atol=0.02)},
    )
    assert by_key.passed
    assert by_key.outputs["out[1]['logits']"].rtol == 1e-4  # default kept where not set
    # The full path wins over the last key.
    full = compare_outputs(
        reference,
        candidate,
        rtol=0.05,
        tolerances={"logits": Tolerance(rtol=0.05), "out[1]['logits']": Tolerance(rtol=1e-6)},
    )
    assert full.outputs["out[0]"].passed
    assert not full.outputs["out[1]['logits']"].passed
    with pytest.raises(ValueError, match=r"no output is named \['scores'\]"):
        compare_outputs(reference, candidate, tolerances={"scores": Tolerance(rtol=1)})


def test_fp16_outputs_against_fp32_reference():
    g = torch.Generator().manual_seed(2)
    reference = {"features": torch.randn(8, 256, generator=g), "count": torch.tensor(8)}
    candidate = {"features": reference["features"].half(), "count": torch.tensor(8)}
    result = compare_outputs(reference, candidate)
    assert result.passed, result.summary()
    assert result.outputs["out['features']"].rtol == 1e-2


def test_compare_outputs_hands_each_detection_list_its_noisy_twins():
    a, b, low = [0.0, 0.0, 100.0, 100.0], [300.0, 0.0, 400.0, 100.0], [0.0, 300.0, 90.0, 400.0]
    reference = {"dets": [one_image([a, low], [0.9, 0.5])], "n": torch.ones(1)}
    candidate = {"dets": [one_image([b, low], [0.9, 0.5])], "n": torch.ones(1)}
    noisy = [{"dets": [one_image([b, low], [0.9, 0.5])], "n": torch.ones(1)}]
    assert not compare_outputs(reference, candidate).passed
    assert compare_outputs(reference, candidate, noisy=noisy).passed
