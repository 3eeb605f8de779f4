"""batched_nms on the CPU against torchvision.ops.batched_nms followed by [:max_detections]."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_testing import assert_padding, make_nms_inputs, torchvision_nms

from bladesmith.ops import batched_nms


def check_against_torchvision(boxes, scores, labels, iou_threshold, max_detections):
    out = batched_nms(boxes, scores, labels, iou_threshold, max_detections)
    out_boxes, out_scores, out_labels, counts = out
    batch = boxes.shape[0]
    assert out_boxes.shape == (batch, max_detections, 4) and counts.shape == (batch,)
    assert out_labels.dtype == counts.dtype == torch.int64
    for b, (ref_boxes, ref_scores, ref_labels) in enumerate(
        torchvision_nms(boxes, scores, labels, iou_threshold, max_detections)
    ):
        n = int(counts[b])
        assert n == len(ref_scores)
        assert_padding(out_boxes[b], out_scores[b], out_labels[b])
        assert torch.equal(out_scores[b, :n], ref_scores)
        assert torch.equal(out_labels[b, :n], ref_labels)
        assert torch.equal(out_boxes[b, :n], ref_boxes)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(0, 3),
    num_boxes=st.integers(0, 80),
    num_labels=st.integers(1, 4),
    padding=st.sampled_from([0.0, 0.3]),
    iou_threshold=st.sampled_from([0.0, 0.3, 0.5, 0.7, 1.0]),
    max_detections=st.integers(0, 90),
)
def test_random_cases_match_torchvision(
    seed, batch, num_boxes, num_labels, padding, iou_threshold, max_detections
):
    inputs = make_nms_inputs(seed, batch, num_boxes, num_labels, padding)
    check_against_torchvision(*inputs, iou_threshold, max_detections)


def test_many_boxes_one_image():
    # Above 4000 coordinates torchvision switches to per-class NMS: the other path.
    check_against_torchvision(*make_nms_inputs(11, 1, 3000, 5, padding=0.2), 0.5, 300)


def test_padding_is_ignored():
    boxes, scores, labels = make_nms_inputs(12, 2, 30, 2)
    # A padding entry with a high score and a box covering everything suppresses nothing.
    boxes[:, 0] = torch.tensor([0.0, 0.0, 64.0, 64.0])
    scores[:, 0], labels[:, 0] = 1.0, -1
    _, _, out_labels, counts = check_against_torchvision(boxes, scores, labels, 0.1, 30)
    assert not bool((out_labels[:, : int(counts.min())] == -1).any())


def test_nan_scores_are_never_selected():
    boxes, scores, labels = make_nms_inputs(13, 2, 40, 3)
    scores[:, ::3] = math.nan
    _, out_scores, _, _ = check_against_torchvision(boxes, scores, labels, 0.5, 40)
    assert not bool(out_scores.isnan().any())


def test_degenerate_boxes():
    boxes = torch.tensor(
        [
            [
                [5.0, 5.0, 5.0, 5.0],  # a point
                [5.0, 5.0, 5.0, 5.0],  # the same point: IoU 0/0 is NaN, no suppression
                [0.0, 0.0, 10.0, 0.0],  # zero height
                [10.0, 10.0, 0.0, 0.0],  # inverted: negative area
                [0.0, 0.0, 10.0, 10.0],
                [0.0, 0.0, 10.0, 10.0],
            ]
        ]  # duplicate: suppressed
    )
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
    labels = torch.zeros(1, 6, dtype=torch.int64)
    *_, counts = check_against_torchvision(boxes, scores, labels, 0.5, 6)
    assert counts.tolist() == [5]


def test_classes_do_not_suppress_each_other():
    boxes = torch.tensor([[[0.0, 0.0, 10.0, 10.0]] * 3])
    scores = torch.tensor([[0.9, 0.8, 0.7]])
    labels = torch.tensor([[0, 1, 0]])
    _, out_scores, out_labels, counts = check_against_torchvision(boxes, scores, labels, 0.5, 3)
    assert counts.tolist() == [2] and out_labels[0].tolist() == [0, 1, -1]


def test_max_detections_keeps_the_best_by_score():
    boxes, scores, labels = make_nms_inputs(14, 1, 50, 4)
    _, out_scores, _, counts = check_against_torchvision(boxes, scores, labels, 0.5, 5)
    assert counts.tolist() == [5]
    assert bool((out_scores[0] >= scores[0].sort(descending=True).values[:5].min()).all())


def test_equal_scores_keep_the_lower_slot_first():
    boxes = torch.tensor(
        [[[20.0, 20.0, 30.0, 30.0], [0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 9.0]]]
    )
    scores = torch.full((1, 3), 0.5)
    labels = torch.zeros(1, 3, dtype=torch.int64)
    out_boxes, _, _, counts = batched_nms(boxes, scores, labels, 0.5, 3)
    assert counts.tolist() == [2] and torch.equal(out_boxes[0, :2], boxes[0, :2])


@pytest.mark.parametrize("batch, num_boxes, max_detections", [(0, 5, 3), (2, 0, 3), (2, 5, 0)])
def test_empty_outputs(batch, num_boxes, max_detections):
    boxes, scores, labels = make_nms_inputs(15, batch, num_boxes, 2)
    check_against_torchvision(boxes, scores, labels, 0.5, max_detections)


def test_non_contiguous_inputs():
    boxes, scores, labels = make_nms_inputs(16, 3, 20, 2)
    check_against_torchvision(
        boxes.transpose(0, 1).contiguous().transpose(0, 1),
        scores.t().contiguous().t(),
        labels[:, :],
        0.5,
        10,
    )
