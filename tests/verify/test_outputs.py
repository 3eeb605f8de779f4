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


def detector_tuple():
    """A TorchScript detector's (boxes, scores, labels) on a 320 x 320 image."""
    boxes = torch.tensor([[10.0, 20.0, 60.0, 90.0], [40.0, 30.0, 300.0, 310.0]])
    return boxes, torch.tensor([0.9, 0.6]), torch.tensor([1, 7])


def test_a_detector_tuple_under_bf16_is_judged_in_pixels_and_exact_labels():
    """Under bfloat16 the measured tolerance of a detector's boxes was about 1,100 px on
    a 320 px image: a box moved 248 px and a label off by one passed. Now the boxes are
    held to the IoU rule (at 0.5: no coordinate past 160 px, each box IoU >= 0.5) and
    labels are exact, and each tolerance says where it came from."""
    from bladesmith.verify import noise_tolerances

    reference = [detector_tuple()]
    inputs = [([{"image": torch.rand(3, 320, 320)}],)]
    floats = {"out[0][0]": reference[0][0], "out[0][1]": reference[0][1]}
    noisy = [{"out[0][0]": reference[0][0] + 275.0, "out[0][1]": reference[0][1] + 0.01}]
    measured = noise_tolerances(
        floats,
        noisy,
        rtol=5e-2,
        unit=2.0**-8,
        unit_name="bfloat16",
        margin=4.0,
        computed_in="bfloat16",
    )
    moved_boxes = reference[0][0].clone()
    moved_boxes[1, [0, 2]] -= 248.0  # [40, 300] -> [-208, 52]: IoU 0.02
    candidate = [(moved_boxes, reference[0][1], reference[0][2] + torch.tensor([0, 1]))]

    def judge(candidate, iou_threshold=0.5, tolerances=measured.tolerances):
        return compare_outputs(
            reference,
            candidate,
            rtol=5e-2,
            atol=1100.0,
            tolerances=tolerances,
            iou_threshold=iou_threshold,
            inputs=inputs,
            computed_in=torch.bfloat16,
            source="measured",
        )

    # Given 1,100 px, the boxes get what the IoU rule allows on the image.
    unmeasured = judge(candidate, tolerances=None).outputs["out[0][0]"]
    assert not unmeasured.passed and unmeasured.atol == unmeasured.ceiling == 160.0
    assert unmeasured.source.startswith("IoU 0.5 rule on a 320x320 image: ")
    assert "<= 160 px; within that, measured" in unmeasured.source
    # Measured, they also get the bfloat16 ceiling: 5% of their range (300 px).
    result = judge(candidate)
    boxes, scores, labels = (result.outputs[f"out[0][{i}]"] for i in range(3))
    assert not boxes.passed and not labels.passed and scores.passed
    assert boxes.atol == boxes.ceiling == pytest.approx(15.0)
    assert boxes.below_iou == 1 and boxes.min_iou < 0.03
    assert boxes.source.startswith("IoU 0.5 rule on a 320x320 image: ")
    assert "capped at 5% of its range 300 (15)" in boxes.source
    assert labels.source == "exact: int64 outputs must be equal"
    assert scores.source.startswith("bfloat16: 4 x what bfloat16 rounding")
    assert set(result.to_dict()["sources"]) == {boxes.source, scores.source, labels.source}
    strict_json(result.to_dict())
    # The same outputs pass; a few pixels pass at 0.9, and a small box moved past its
    # own IoU (but within the image's ceiling) fails.
    assert judge(reference, 0.9).passed
    nudged = reference[0][0] + torch.tensor([[1.0, -1.0, 1.0, 0.5], [3.0, 2.0, -4.0, 1.0]])
    assert judge([(nudged, *reference[0][1:])], 0.9).passed
    small = reference[0][0].clone()
    small[0] += 10.0  # a 50 x 70 box moved 10 px: IoU 0.52, each coordinate within 15 px
    shifted = judge([(small, *reference[0][1:])], 0.9).outputs["out[0][0]"]
    assert not shifted.passed and shifted.below_iou == 1 and shifted.out_of_tolerance == 0
    assert "1 boxes below it" in shifted.summary()
