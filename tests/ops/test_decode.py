"""retinanet_decode on the CPU against torchvision's postprocess_detections before NMS."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_testing import (
    UNIT_WEIGHTS,
    assert_descending,
    assert_padding,
    assert_same_detections,
    decode_cases,
    level_topk,
    make_decode_inputs,
    torchvision_level_candidates,
)

from bladesmith.ops import BBOX_CLIP, retinanet_decode

THREADS = torch.get_num_threads()


def check_against_torchvision(inputs, score_threshold, topk, weights=UNIT_WEIGHTS, clip=BBOX_CLIP):
    boxes, scores, labels = retinanet_decode(
        **inputs,
        score_threshold=score_threshold,
        topk_candidates=topk,
        weights=weights,
        bbox_clip=clip,
    )
    batch, _, num_classes = inputs["cls_logits"].shape
    ks = level_topk(inputs["level_sizes"], num_classes, topk)
    assert boxes.shape == (batch, sum(ks), 4)
    assert scores.shape == (batch, sum(ks)) and labels.shape == (batch, sum(ks))
    assert labels.dtype == torch.int64 and boxes.dtype == inputs["cls_logits"].dtype
    start = 0
    for level, k in enumerate(ks):
        reference = torchvision_level_candidates(
            inputs, level, score_threshold, topk, weights=weights, bbox_clip=clip
        )
        for b in range(batch):
            segment = slice(start, start + k)
            assert_padding(boxes[b, segment], scores[b, segment], labels[b, segment])
            count = int((labels[b, segment] != -1).sum())
            ours = (boxes[b, segment][:count], scores[b, segment][:count])
            assert_descending(ours[1])
            assert_same_detections((*ours, labels[b, segment][:count]), reference[b])
        start += k
    return boxes, scores, labels


@settings(max_examples=40, deadline=None)
@given(
    case=decode_cases(),
    topk=st.integers(0, 60),
    score_threshold=st.sampled_from([0.05, 0.3, 0.5, 0.9]),
    weights=st.sampled_from([UNIT_WEIGHTS, (10.0, 10.0, 5.0, 5.0), (2.0, 0.5, 1.5, 3.0)]),
    clip=st.sampled_from([BBOX_CLIP, 1.0, math.inf]),
)
def test_random_cases_match_torchvision(case, topk, score_threshold, weights, clip):
    check_against_torchvision(make_decode_inputs(**case), score_threshold, topk, weights, clip)


def test_realistic_load_many_candidates_above_threshold():
    # Most scores pass 0.05, so every large level is cut to its top 1000; the first level's
    # 96,000 logits are selected in chunks, on several threads, and merged.
    inputs = make_decode_inputs(3, 2, [4800, 400, 100, 25], 20, logit_mean=-1.0, max_image_size=640)
    boxes, scores, labels = check_against_torchvision(inputs, 0.05, 1000)
    assert int((labels[:, :3000] != -1).sum()) == 2 * 3000
    torch.set_num_threads(1)
    try:
        serial = retinanet_decode(**inputs, score_threshold=0.05, topk_candidates=1000)
    finally:
        torch.set_num_threads(THREADS)
    assert all(torch.equal(a, b) for a, b in zip(serial, (boxes, scores, labels)))


def test_no_candidate_above_threshold_gives_only_padding():
    inputs = make_decode_inputs(0, 2, [20, 5], 3, logit_mean=-30.0)
    boxes, scores, labels = retinanet_decode(**inputs, score_threshold=0.05, topk_candidates=10)
    assert labels.shape == (2, 20) and bool((labels == -1).all())
    assert bool((boxes == 0).all() and (scores == 0).all())


def test_fewer_candidates_than_slots():
    inputs = make_decode_inputs(1, 1, [30, 10], 4)
    inputs["cls_logits"].fill_(-10.0)
    inputs["cls_logits"][0, 3, 2] = 1.0  # level 0: anchor 3, class 2
    inputs["cls_logits"][0, 35, 0] = 2.0  # level 1: anchor 5, class 0
    boxes, scores, labels = check_against_torchvision(inputs, 0.5, 50)
    assert labels[0].tolist() == [2] + [-1] * 49 + [0] + [-1] * 39
    assert scores[0, 0] == torch.sigmoid(torch.tensor(1.0)) and scores[0, 50] > scores[0, 0]


def test_nan_logits_are_never_selected():
    inputs = make_decode_inputs(2, 2, [25, 9], 3, logit_mean=1.0)
    inputs["cls_logits"][:, ::2] = math.nan
    boxes, scores, labels = check_against_torchvision(inputs, 0.05, 40)
    assert not bool(scores.isnan().any())


def test_nan_and_huge_deltas_decode_as_torchvision():
    inputs = make_decode_inputs(4, 1, [20], 2, logit_mean=3.0)
    inputs["bbox_deltas"][0, :5] = math.nan
    inputs["bbox_deltas"][0, 5:10] = 1e6  # clipped by bbox_clip before exp
    check_against_torchvision(inputs, 0.05, 40)


def test_degenerate_anchors_and_empty_images():
    inputs = make_decode_inputs(5, 3, [12, 4], 3, logit_mean=2.0, per_image_anchors=True)
    inputs["anchors"][:, :6, 2:] = inputs["anchors"][:, :6, :2]  # zero-area anchors
    inputs["anchors"][:, 6:8, 2] = inputs["anchors"][:, 6:8, 0] - 5  # inverted anchors
    inputs["image_sizes"][1] = torch.tensor([0, 0])  # every box clips to a point
    boxes, _, labels = check_against_torchvision(inputs, 0.05, 30)
    assert bool((boxes[1][labels[1] != -1] == 0).all())


@pytest.mark.parametrize("batch, topk, classes", [(0, 5, 3), (2, 0, 3), (2, 5, 0)])
def test_empty_outputs(batch, topk, classes):
    inputs = make_decode_inputs(6, batch, [7, 3], classes)
    boxes, scores, labels = retinanet_decode(**inputs, score_threshold=0.1, topk_candidates=topk)
    k = sum(level_topk([7, 3], classes, topk))
    assert boxes.shape == (batch, k, 4) and scores.shape == labels.shape == (batch, k)


def test_ties_are_ordered_by_anchor_then_class():
    inputs = make_decode_inputs(7, 1, [6], 2)
    inputs["cls_logits"].fill_(-10.0)
    inputs["bbox_deltas"].zero_()
    inputs["image_sizes"].fill_(10_000)  # no clipping: the boxes are the anchors
    for anchor, cls in [(4, 0), (1, 1), (1, 0), (3, 1)]:
        inputs["cls_logits"][0, anchor, cls] = 2.0
    boxes, _, labels = retinanet_decode(**inputs, score_threshold=0.5, topk_candidates=3)
    # Flat indices 2 (anchor 1, class 0), 3 (anchor 1, class 1), 7 (anchor 3, class 1).
    assert labels[0].tolist() == [0, 1, 1]
    assert torch.allclose(boxes[0], inputs["anchors"][[1, 1, 3]])


def test_score_threshold_is_strict_and_rounded_like_torch():
    inputs = make_decode_inputs(8, 1, [4], 1)
    inputs["cls_logits"][0, :, 0] = torch.tensor([0.0, 0.0, 1e-3, -1e-3])
    _, scores, labels = retinanet_decode(**inputs, score_threshold=0.5, topk_candidates=4)
    assert labels[0].tolist() == [0, -1, -1, -1]  # only sigmoid(1e-3) > 0.5
