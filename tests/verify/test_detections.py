"""verify.detections: order-free matching by class and IoU."""

from __future__ import annotations

import math

import pytest
import torch
from verify_testing import make_detections, one_image, strict_json, take

from bladesmith.verify import (
    compare_detections,
)


def test_shuffled_detections_match_perfectly():
    reference = [make_detections(seed=1), make_detections(seed=2)]
    candidate = [take(d, torch.randperm(len(d["scores"]))) for d in reference]
    result = compare_detections(reference, candidate)
    assert result.passed, result.summary()
    assert result.f1 == 1.0 and result.matched == 100
    assert result.max_box_deviation == 0.0 and result.max_score_deviation == 0.0
    assert result.mean_iou == pytest.approx(1.0)


def test_small_box_and_score_deviations_are_reported():
    reference = [make_detections()]
    candidate = [dict(reference[0])]
    candidate[0]["boxes"] = reference[0]["boxes"] + torch.tensor([0.5, 0.0, 0.0, -0.25])
    candidate[0]["scores"] = reference[0]["scores"] + 5e-5
    result = compare_detections(reference, candidate)
    assert result.passed
    assert result.max_box_deviation == pytest.approx(0.5)
    assert result.max_score_deviation == pytest.approx(5e-5, rel=1e-2)
    assert "max box dev 0.5 px" in result.summary()

    too_far = compare_detections(reference, candidate, score_atol=1e-5)
    assert not too_far.passed
    assert "a matched score moved by 5e-5" in too_far.summary()
    assert too_far.tolerance_ratio == pytest.approx(5.0, rel=1e-2)


def test_shifted_boxes_fall_below_iou_and_fail():
    reference = [make_detections()]
    shifted = dict(reference[0], boxes=reference[0]["boxes"] + 15.0)
    result = compare_detections(reference, [shifted])
    assert not result.passed
    assert result.f1 < 0.99
    assert "below 0.99" in result.summary()


def test_boxes_clipped_flat_at_the_image_edge_match_by_their_segments():
    # A detector clips a box past the image to its edge (x1 == x2 == 160): no area,
    # so their IoU is that of the two segments. Rounding moves them by 3e-4 px, as
    # SSD300's were; a segment moved along the edge, or off it, is another detection.
    edge = [[160.0, 15.89, 160.0, 128.0], [20.0, 128.0, 90.0, 128.0]]
    reference = [one_image(edge, [0.9, 0.8])]
    rounded = [[160.0, 15.8903, 160.0, 127.9997], [20.0002, 128.0, 90.0, 128.0]]
    result = compare_detections(reference, [one_image(rounded, [0.9, 0.8])])
    assert result.passed and result.matched == 2, result.summary()
    moved = [[160.0, 80.0, 160.0, 128.0], [20.0, 127.0, 90.0, 127.0]]  # IoU 0.4; parallel
    result = compare_detections(reference, [one_image(moved, [0.9, 0.8])])
    assert not result.passed and result.matched == 0, result.summary()


def test_class_swap_does_not_match():
    reference = [make_detections(n=10)]
    swapped = dict(reference[0], labels=(reference[0]["labels"] + 1) % 5)
    result = compare_detections(reference, [swapped])
    assert not result.passed
    assert result.matched == 0 and result.f1 == 0.0


def test_one_missed_detection_in_many_is_within_min_f1():
    reference = [make_detections(n=200)]
    candidate = [take(reference[0], torch.arange(1, 200))]
    result = compare_detections(reference, candidate)
    assert result.recall == pytest.approx(199 / 200) and result.precision == 1.0
    assert result.f1 == pytest.approx(2 * 0.995 / 1.995)
    assert result.passed
    assert not compare_detections(reference, candidate, min_f1=1.0).passed


def test_matching_is_one_to_one():
    reference = [take(make_detections(n=1), torch.tensor([0]))]
    duplicate = [take(reference[0], torch.tensor([0, 0]))]
    result = compare_detections(reference, duplicate)
    assert result.matched == 1
    assert result.precision == 0.5 and result.recall == 1.0


def test_matching_stays_within_each_image():
    first, second = make_detections(seed=3), make_detections(seed=4)
    assert not compare_detections([first, second], [second, first]).passed


def test_empty_detections():
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0)}
    assert compare_detections([empty], [empty]).f1 == 1.0
    missed = compare_detections([make_detections(n=3)], [empty])
    assert not missed.passed and missed.recall == 0.0


def test_nonfinite_candidate_detections_match_nothing():
    reference = [make_detections(n=4)]
    broken = dict(reference[0], scores=reference[0]["scores"].clone())
    broken["scores"][0] = math.nan
    result = compare_detections(reference, [broken], min_f1=0.5)
    assert result.matched == 3
    assert not result.passed
    assert "1 candidate detections have NaN/inf" in result.summary()
    strict_json(result.to_dict())


def test_malformed_detections():
    reference = [make_detections(n=3)]
    with pytest.raises(ValueError, match=r"reference\[0\]: expected boxes \[n, 4\]"):
        compare_detections([dict(reference[0], boxes=torch.zeros(3, 5))], reference)
    result = compare_detections(reference, [{"boxes": torch.zeros(3, 4)}])
    assert not result.passed
    assert "candidate[0]: expected a dict with keys" in result.summary()
    images = compare_detections(reference, reference * 2)
    assert not images.passed and "2 images of detections" in images.summary()


def test_labels_match_exactly_and_tolerances_say_where_they_come_from():
    reference = [make_detections(seed=3)]
    off_by_one = [{**reference[0], "labels": reference[0]["labels"] + 1}]
    assert compare_detections(reference, off_by_one).f1 == 0.0
    # Float labels a bfloat16 pipeline rounded: 2.99 is not class 2.
    floats = reference[0]["labels"].float()
    assert compare_detections(reference, [{**reference[0], "labels": floats}]).passed
    rounded = [{**reference[0], "labels": floats - 0.01}]
    result = compare_detections(reference, rounded)
    assert not result.passed
    assert "candidate labels are not whole numbers" in result.summary()
    at_640 = compare_detections(reference, reference, iou_threshold=0.5, image_size=(640, 480))
    assert at_640.box_ceiling == 320.0
    assert at_640.source.startswith(
        "matched by class and IoU 0.5 rule on a 640x480 image: a box keeps IoU >= 0.5"
    )
    assert at_640.source.endswith("scores within 0.005: floor for TF32 convolutions")
    assert "(IoU rule: <= 320 px)" in at_640.summary()
    assert at_640.to_dict()["source"] == at_640.source
