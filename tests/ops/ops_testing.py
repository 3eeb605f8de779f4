"""Shared by the operator tests: inputs, torchvision references, order-free comparison."""

from __future__ import annotations

import math
from types import SimpleNamespace
from unittest import mock

import torch
import torchvision
import torchvision.ops.boxes as box_ops
from hypothesis import strategies as st
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection.retinanet import RetinaNet

from bladesmith.ops import BBOX_CLIP

UNIT_WEIGHTS = (1.0, 1.0, 1.0, 1.0)
# IoU never exceeds 1, so NMS at this threshold suppresses nothing.
NO_SUPPRESSION = 2.0


def make_decode_inputs(
    seed: int,
    batch: int,
    level_sizes: list[int],
    num_classes: int,
    *,
    logit_mean: float = -1.0,
    per_image_anchors: bool = False,
    max_image_size: int = 96,
) -> dict:
    """Random head outputs and anchors in the shapes retinanet_decode takes (float32)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(level_sizes)
    anchor_batch = (batch,) if per_image_anchors else ()
    corner = torch.rand(*anchor_batch, n, 2, generator=g) * max_image_size
    extent = torch.rand(*anchor_batch, n, 2, generator=g) * max_image_size / 2 + 1
    sizes = torch.randint(max_image_size // 4, max_image_size + 1, (batch, 2), generator=g)
    return dict(
        cls_logits=torch.randn(batch, n, num_classes, generator=g) * 2 + logit_mean,
        # Large enough for some widths and heights to reach bbox_clip.
        bbox_deltas=torch.randn(batch, n, 4, generator=g) * 1.5,
        anchors=torch.cat([corner, corner + extent], dim=-1),
        level_sizes=list(level_sizes),
        image_sizes=sizes.to(torch.int64),
    )


def torchvision_postprocess(
    inputs: dict,
    score_threshold: float,
    topk_candidates: int,
    iou_threshold: float,
    max_detections: int,
    weights=UNIT_WEIGHTS,
    bbox_clip: float = BBOX_CLIP,
) -> list[dict]:
    """torchvision's own RetinaNet.postprocess_detections on the same inputs.

    Its batched_nms shifts boxes by label * (max coordinate + 1) for small inputs, which
    rounds coordinates and moves IoUs near the threshold; the per-class path it takes for
    large inputs is the exact form, so the reference always takes that one.
    """
    model = SimpleNamespace(
        score_thresh=score_threshold,
        topk_candidates=topk_candidates,
        nms_thresh=iou_threshold,
        detections_per_img=max_detections,
        box_coder=det_utils.BoxCoder(weights, bbox_clip),
    )
    levels = inputs["level_sizes"]
    batch = inputs["cls_logits"].shape[0]
    anchors = inputs["anchors"]
    if anchors.dim() == 2:
        anchors = anchors.expand(batch, -1, -1)
    head = {
        "cls_logits": list(inputs["cls_logits"].split(levels, dim=1)),
        "bbox_regression": list(inputs["bbox_deltas"].split(levels, dim=1)),
    }
    per_image_anchors = [list(a.split(levels)) for a in anchors]
    image_shapes = [tuple(s) for s in inputs["image_sizes"].tolist()]
    with mock.patch.object(box_ops, "_batched_nms_coordinate_trick", box_ops._batched_nms_vanilla):
        return RetinaNet.postprocess_detections(model, head, per_image_anchors, image_shapes)


def torchvision_level_candidates(inputs: dict, level: int, score_threshold, topk, **coder):
    """torchvision's candidates of one level (before NMS), per image."""
    start = sum(inputs["level_sizes"][:level])
    size = inputs["level_sizes"][level]
    anchors = inputs["anchors"]
    one_level = dict(
        inputs,
        cls_logits=inputs["cls_logits"][:, start : start + size],
        bbox_deltas=inputs["bbox_deltas"][:, start : start + size],
        anchors=anchors[..., start : start + size, :],
        level_sizes=[size],
    )
    return torchvision_postprocess(one_level, score_threshold, topk, NO_SUPPRESSION, 10**9, **coder)


def level_topk(level_sizes, num_classes: int, topk: int) -> list[int]:
    return [min(topk, n * num_classes) for n in level_sizes]


def assert_padding(boxes, scores, labels) -> None:
    """Valid entries first, then padding slots holding box 0, score 0, label -1."""
    valid = labels != -1
    count = int(valid.sum())
    assert bool(valid[:count].all()), "padding slots before valid ones"
    assert bool((boxes[count:] == 0).all() and (scores[count:] == 0).all())


def assert_descending(scores) -> None:
    assert bool((scores[:-1] >= scores[1:]).all()), f"scores not descending: {scores}"


def assert_same_detections(
    ours: tuple, reference: dict, *, box_rtol=1e-5, box_atol=1e-4, score_atol=5e-7
) -> None:
    """Same multiset of (label, score, box) within tolerance, in any order: implementations
    may order equal scores differently. Matches greedily, one reference per detection."""
    boxes, scores, labels = ours
    ref_boxes, ref_scores, ref_labels = (reference[k] for k in ("boxes", "scores", "labels"))
    assert len(scores) == len(ref_scores), (
        f"{len(scores)} detections, torchvision has {len(ref_scores)}"
    )
    if len(scores) == 0:
        return
    boxes, ref_boxes = boxes.double(), ref_boxes.double()
    close = (
        (labels[:, None] == ref_labels[None])
        & ((scores.double()[:, None] - ref_scores.double()[None]).abs() <= score_atol)
        & torch.isclose(
            # expanded by hand: isclose's broadcasting fails on CUDA in torch 2.11
            boxes[:, None].expand(-1, len(ref_boxes), 4),
            ref_boxes[None].expand(len(boxes), -1, 4),
            box_rtol,
            box_atol,
            equal_nan=True,
        ).all(-1)
    )
    taken = torch.zeros(len(ref_scores), dtype=torch.bool)
    for i in range(len(scores)):
        free = (close[i] & ~taken).nonzero()
        assert len(free), (
            f"detection {i} (label {int(labels[i])}, score {float(scores[i])}, box "
            f"{boxes[i].tolist()}) matches none of torchvision's"
        )
        taken[free[0]] = True


def logit(p: float) -> float:
    return math.log(p / (1 - p))


@st.composite
def decode_cases(draw, max_level_size=40, max_levels=4, max_classes=6):
    """Shapes and logit levels for random decode cases (hypothesis)."""
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        batch=draw(st.integers(0, 3)),
        level_sizes=draw(st.lists(st.integers(0, max_level_size), min_size=1, max_size=max_levels)),
        num_classes=draw(st.integers(1, max_classes)),
        logit_mean=draw(st.floats(-4.0, 2.0)),
        per_image_anchors=draw(st.booleans()),
    )


def make_nms_inputs(seed, batch, num_boxes, num_labels, padding=0.0):
    """Coordinates on a 1/4 grid below 64 and distinct scores: torchvision's batched_nms
    shifts boxes by label * (max + 1), which is exact for these, so results must agree
    bit for bit, ties of IoU with the threshold included."""
    g = torch.Generator().manual_seed(seed)
    corner = torch.randint(0, 160, (batch, num_boxes, 2), generator=g) / 4
    extent = torch.randint(0, 96, (batch, num_boxes, 2), generator=g) / 4  # 0: zero area
    scores = torch.rand(batch, 4096, generator=g).argsort(dim=1)[:, :num_boxes]
    labels = torch.randint(0, num_labels, (batch, num_boxes), generator=g)
    pad = torch.rand(batch, num_boxes, generator=g) < padding
    boxes = torch.cat([corner, corner + extent], dim=-1).masked_fill(pad[..., None], 0)
    scores = (scores.float() / 4096 + 1 / 8192).masked_fill(pad, 0)
    return boxes, scores, labels.masked_fill(pad, -1)


def torchvision_nms(boxes, scores, labels, iou_threshold, max_detections):
    """Per image: the non-padding, non-NaN entries through torchvision, then the top."""
    results = []
    for image_boxes, image_scores, image_labels in zip(boxes, scores, labels):
        valid = (image_labels >= 0) & ~image_scores.isnan()
        kept = [image_boxes[valid], image_scores[valid], image_labels[valid]]
        keep = torchvision.ops.batched_nms(*kept, iou_threshold)[:max_detections]
        results.append(tuple(t[keep] for t in kept))
    return results
