"""retinanet_postprocess on the CPU against torchvision's RetinaNet.postprocess_detections."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_testing import (
    UNIT_WEIGHTS,
    assert_descending,
    assert_padding,
    assert_same_detections,
    make_decode_inputs,
    torchvision_postprocess,
)

from bladesmith.ops import BBOX_CLIP, batched_nms, retinanet_decode, retinanet_postprocess


def check_against_torchvision(
    inputs, score_threshold, topk, iou_threshold, max_detections, weights=UNIT_WEIGHTS
):
    out = retinanet_postprocess(
        **inputs,
        score_threshold=score_threshold,
        topk_candidates=topk,
        iou_threshold=iou_threshold,
        max_detections=max_detections,
        weights=weights,
    )
    boxes, scores, labels, counts = out
    batch = inputs["cls_logits"].shape[0]
    assert boxes.shape == (batch, max_detections, 4) and counts.shape == (batch,)
    reference = torchvision_postprocess(
        inputs, score_threshold, topk, iou_threshold, max_detections, weights
    )
    for b in range(batch):
        n = int(counts[b])
        assert_padding(boxes[b], scores[b], labels[b])
        assert_descending(scores[b, :n])
        assert_same_detections((boxes[b, :n], scores[b, :n], labels[b, :n]), reference[b])
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(0, 3),
    level_sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    num_classes=st.integers(1, 5),
    logit_mean=st.floats(-3.0, 2.0),
    per_image_anchors=st.booleans(),
    topk=st.integers(0, 60),
    score_threshold=st.sampled_from([0.05, 0.3, 0.7]),
    iou_threshold=st.sampled_from([0.3, 0.5, 0.7]),
    max_detections=st.integers(0, 50),
    weights=st.sampled_from([UNIT_WEIGHTS, (10.0, 10.0, 5.0, 5.0)]),
)
def test_random_cases_match_torchvision(
    seed,
    batch,
    level_sizes,
    num_classes,
    logit_mean,
    per_image_anchors,
    topk,
    score_threshold,
    iou_threshold,
    max_detections,
    weights,
):
    inputs = make_decode_inputs(
        seed,
        batch,
        level_sizes,
        num_classes,
        logit_mean=logit_mean,
        per_image_anchors=per_image_anchors,
    )
    check_against_torchvision(inputs, score_threshold, topk, iou_threshold, max_detections, weights)


def test_realistic_load():
    # torchvision's RetinaNet defaults, with most scores above the threshold.
    inputs = make_decode_inputs(
        21, 2, [1600, 400, 100, 25, 9], 20, logit_mean=-1.0, max_image_size=640
    )
    *_, counts = check_against_torchvision(inputs, 0.05, 1000, 0.5, 300)
    assert counts.tolist() == [300, 300]


def test_no_detections():
    inputs = make_decode_inputs(22, 2, [20, 5], 3, logit_mean=-30.0)
    boxes, scores, labels, counts = check_against_torchvision(inputs, 0.05, 10, 0.5, 8)
    assert counts.tolist() == [0, 0] and bool((labels == -1).all())


def test_equals_decode_then_nms():
    inputs = make_decode_inputs(23, 3, [50, 20, 6], 4, logit_mean=0.0, per_image_anchors=True)
    decoded = retinanet_decode(
        **inputs,
        score_threshold=0.2,
        topk_candidates=30,
        weights=(2.0, 2.0, 1.0, 1.0),
        bbox_clip=BBOX_CLIP / 2,
    )
    expected = batched_nms(*decoded, 0.4, 25)
    fused = retinanet_postprocess(
        **inputs,
        score_threshold=0.2,
        topk_candidates=30,
        iou_threshold=0.4,
        max_detections=25,
        weights=(2.0, 2.0, 1.0, 1.0),
        bbox_clip=BBOX_CLIP / 2,
    )
    for a, b in zip(fused, expected):
        assert torch.equal(a, b)
