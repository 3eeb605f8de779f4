"""verify.fields: masks, keypoints and keypoint scores judged on the matched detections;
a field with no measure named as not verified."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.models import detection
from verify_testing import make_detections, one_image, strict_json, take

from bladesmith.engine.reference import reference_under_noise
from bladesmith.verify import compare_detections, compare_outputs
from bladesmith.verify.tolerance import FLOAT32_NOISE

SMALL = dict(
    weights=None,
    weights_backbone=None,
    num_classes=3,
    min_size=64,
    max_size=96,
    box_score_thresh=0.0,  # random weights: keep some detections
    rpn_pre_nms_top_n_test=50,
    rpn_post_nms_top_n_test=20,
    box_detections_per_img=10,
)


def torchvision_outputs(builder: str, **settings):
    """A random-weight torchvision detector, its detections on one small image, and the
    same under float32 rounding noise (what a float32 pass moves them by)."""
    torch.manual_seed(0)
    model = getattr(detection, builder)(**SMALL, **settings).eval()
    images = [torch.rand(3, 64, 96)]
    with torch.no_grad():
        outputs = model(images)
    (noisy,) = reference_under_noise(model, [(images,)], runs=1, relative=FLOAT32_NOISE)[0]
    assert len(outputs[0]["scores"]) == 10
    return outputs, noisy


@pytest.fixture(scope="module")
def masks():
    return torchvision_outputs("maskrcnn_resnet50_fpn")


@pytest.fixture(scope="module")
def keypoints():
    return torchvision_outputs("keypointrcnn_resnet50_fpn", num_keypoints=3)


def changed(outputs, key, change):
    return [dict(image, **{key: change(image[key].clone())}) for image in outputs]


def test_mask_rcnn_masks_are_judged(masks):
    reference, noisy = masks
    same = compare_detections(reference, noisy)
    assert same.passed, same.summary()
    assert same.fields["masks"].deviation < 1e-2
    assert "max mask dev" in same.summary()
    strict_json(same.to_dict())
    inverted = compare_detections(reference, changed(reference, "masks", lambda m: 1 - m))
    assert not inverted.passed
    assert "matched masks moved past tolerance" in inverted.summary()
    assert inverted.f1 == 1.0  # the boxes still match: only the masks are wrong


def test_keypoint_rcnn_keypoints_and_their_scores_are_judged(keypoints):
    reference, noisy = keypoints
    same = compare_detections(reference, noisy)
    assert same.passed, same.summary()
    assert set(same.fields) == {"keypoints", "keypoints visibility", "keypoints_scores"}

    # A box of side s moved by s / 19 keeps IoU 0.9: a keypoint may move as far (s: the
    # larger side of its box).
    boxes = reference[0]["boxes"]
    side = (boxes[:, 2:] - boxes[:, :2]).amax(1).min()
    far = float(side) / 19 * 1.5
    shifted = changed(reference, "keypoints", lambda p: p + torch.tensor([far, 0.0, 0.0]))
    result = compare_detections(reference, shifted)
    assert not result.passed and "matched keypoints moved past tolerance" in result.summary()
    near = float(side) / 19 * 0.5
    nudged = changed(reference, "keypoints", lambda p: p + torch.tensor([near, -near, 0.0]))
    assert compare_detections(reference, nudged).passed

    hidden = changed(reference, "keypoints", lambda p: p * torch.tensor([1.0, 1.0, 0.0]))
    result = compare_detections(reference, hidden)
    assert not result.passed
    assert "matched keypoints visibility moved past tolerance" in result.summary()

    negated = changed(reference, "keypoints_scores", lambda s: -s)
    result = compare_detections(reference, negated)
    assert not result.passed and "keypoints_scores moved past tolerance" in result.summary()
    # Heatmap logits are unbounded: judged relative to their size past 1.
    scaled = changed(reference, "keypoints_scores", lambda s: s * (1 + 2e-3))
    assert compare_detections(reference, scaled).passed


def mask_detections(n=4, seed=0):
    detections = make_detections(n=n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    detections["masks"] = torch.rand(n, 1, 20, 30, generator=g)
    return detections


def one_masked(box, flipped: int):
    """One detection at ``box`` with an empty 40 x 40 mask, and the same with its first
    ``flipped`` pixels set."""
    reference = dict(one_image([box], [0.9]), masks=torch.zeros(1, 1, 40, 40))
    masks = reference["masks"].clone()
    masks.view(-1)[:flipped] = 1.0
    return [reference], [dict(reference, masks=masks)]


def test_masks_flipped_within_rounding_at_the_threshold_still_match():
    reference, candidate = one_masked([0.0, 0.0, 10.0, 10.0], flipped=0)
    reference[0]["masks"].view(-1)[:30] = 0.52
    candidate[0]["masks"].view(-1)[:30] = 0.49  # across 0.5 by less than 0.05
    assert compare_detections(reference, candidate, score_atol=0.05).passed
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert not result.passed and result.fields["masks"].deviation == pytest.approx(0.3)


def test_masks_are_compared_with_their_matched_detections_in_any_order():
    reference = [mask_detections(n=6)]
    candidate = [take(reference[0], torch.randperm(6, generator=torch.Generator().manual_seed(1)))]
    result = compare_detections(reference, candidate)
    assert result.passed and result.fields["masks"].deviation == 0.0


def test_a_nonfinite_or_misshapen_field_fails():
    reference = [mask_detections()]
    broken = reference[0]["masks"].clone()
    broken[0, 0, 0, 0] = math.nan
    result = compare_detections(reference, [dict(reference[0], masks=broken)])
    assert not result.passed and result.fields["masks"].deviation == math.inf
    strict_json(result.to_dict())
    smaller = dict(reference[0], masks=reference[0]["masks"][..., :10])
    result = compare_detections(reference, [smaller])
    assert not result.passed
    assert "candidate masks is [4, 1, 20, 10], where the reference's is [n, 1, 20, 30]" in (
        result.summary()
    )


def test_a_missing_or_added_field_fails():
    reference = [mask_detections()]
    without = {k: v for k, v in reference[0].items() if k != "masks"}
    result = compare_detections(reference, [without])
    assert not result.passed and "candidate keys" in result.summary()
    assert not compare_detections([without], reference).passed


def test_a_field_with_no_measure_is_named_as_not_verified():
    reference = [dict(make_detections(n=3), embedding=torch.rand(3, 8))]
    other = [dict(reference[0], embedding=torch.rand(3, 8))]
    result = compare_detections(reference, other)
    assert result.passed and result.unverified == ["embedding"]
    assert "not verified: 'embedding'" in result.summary()
    assert result.to_dict()["unverified"] == ["embedding"]
    # A known key that is not one row per detection has no measure either.
    odd = [dict(make_detections(n=3), masks=torch.rand(5, 5))]
    assert compare_detections(odd, odd).unverified == ["masks"]
    # Among several outputs, the comparison's summary names it too.
    both = compare_outputs((reference, torch.ones(2)), (other, torch.ones(2) * (1 + 5e-5)))
    assert both.passed and "not verified: out[0]['embedding']" in both.summary()


def test_masks_may_flip_what_a_box_moved_within_the_iou_threshold_changes():
    """A box moved as far as IoU 0.9 allows changes 2 x 0.1 / 1.9 = 10.5% of its area:
    a mask may flip as many pixels, at the scale of its own box."""
    reference, candidate = one_masked([0.0, 0.0, 10.0, 10.0], flipped=10)
    result = compare_detections(reference, candidate)
    assert result.passed and result.fields["masks"].deviation == pytest.approx(0.1)
    assert "max mask dev 10% of its box's area at 0.5 (max 10.5%)" in result.summary()
    reference, candidate = one_masked([0.0, 0.0, 10.0, 10.0], flipped=20)
    assert not compare_detections(reference, candidate).passed
    loose = compare_detections(reference, candidate, field_tolerances={"masks": 0.25})
    assert loose.passed and loose.fields["masks"].tolerance == 0.25
    assert compare_outputs(reference, candidate, field_tolerances={"masks": 0.25}).passed
    reference, candidate = one_masked([0.0, 0.0, 20.0, 20.0], flipped=20)
    assert compare_detections(reference, candidate).passed  # 5% of a larger box


def test_no_matched_detection_leaves_a_field_unmeasured():
    empty = {
        "boxes": torch.zeros(0, 4),
        "scores": torch.zeros(0),
        "labels": torch.zeros(0, dtype=torch.int64),
        "keypoints": torch.zeros(0, 3, 3),
    }
    result = compare_detections([empty], [empty])
    assert result.passed and result.fields["keypoints"].deviation is None
    assert "max keypoint dev n/a" in result.summary()
    strict_json(result.to_dict())
