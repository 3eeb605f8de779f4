"""Bad input raises an error naming the argument, from the C++ checks (CPU tensors) and
from their mirror in the fake kernels (meta tensors), with the same message."""

import math

import pytest
import torch

from bladesmith.ops import batched_nms, retinanet_decode, retinanet_postprocess


def decode_args(device="cpu"):
    return dict(
        cls_logits=torch.zeros(2, 10, 3, device=device),
        bbox_deltas=torch.zeros(2, 10, 4, device=device),
        anchors=torch.zeros(10, 4, device=device),
        level_sizes=[6, 4],
        image_sizes=torch.zeros(2, 2, dtype=torch.int64, device=device),
        score_threshold=0.05,
        topk_candidates=5,
    )


def nms_args(device="cpu"):
    return dict(
        boxes=torch.zeros(2, 7, 4, device=device),
        scores=torch.zeros(2, 7, device=device),
        labels=torch.zeros(2, 7, dtype=torch.int64, device=device),
        iou_threshold=0.5,
        max_detections=5,
    )


def tensor_change(name, make):
    """Replace argument `name` by make(original)."""
    return lambda args: {**args, name: make(args[name])}


def value(name, new):
    return lambda args: {**args, name: new}


DECODE_CASES = [
    ("cls_logits", ValueError, tensor_change("cls_logits", lambda t: t[0])),
    ("cls_logits", TypeError, tensor_change("cls_logits", lambda t: t.to(torch.int32))),
    ("cls_logits", TypeError, tensor_change("cls_logits", lambda t: t.double())),
    ("bbox_deltas", ValueError, tensor_change("bbox_deltas", lambda t: t[:, :9])),
    ("bbox_deltas", ValueError, tensor_change("bbox_deltas", lambda t: t[:1])),
    ("bbox_deltas", ValueError, tensor_change("bbox_deltas", lambda t: t[..., :3])),
    ("bbox_deltas", TypeError, tensor_change("bbox_deltas", lambda t: t.half())),
    ("anchors", ValueError, tensor_change("anchors", lambda t: t[0])),
    ("anchors", ValueError, tensor_change("anchors", lambda t: t[:9])),
    ("anchors", ValueError, tensor_change("anchors", lambda t: t.expand(3, -1, -1))),
    ("anchors", ValueError, tensor_change("anchors", lambda t: t[:, :2])),
    ("anchors", TypeError, tensor_change("anchors", lambda t: t.half())),
    ("image_sizes", TypeError, tensor_change("image_sizes", lambda t: t.int())),
    ("image_sizes", ValueError, tensor_change("image_sizes", lambda t: t[:, :1])),
    ("image_sizes", ValueError, tensor_change("image_sizes", lambda t: t[:1])),
    ("level_sizes", ValueError, value("level_sizes", [6, 5])),
    ("level_sizes", ValueError, value("level_sizes", [12, -2])),
    ("score_threshold", ValueError, value("score_threshold", math.nan)),
    ("topk_candidates", ValueError, value("topk_candidates", -1)),
    ("weights", ValueError, value("weights", [1.0, 1.0, 1.0])),
    ("weights", ValueError, value("weights", [1.0, 0.0, 1.0, 1.0])),
    ("weights", ValueError, value("weights", [1.0, math.inf, 1.0, 1.0])),
    ("bbox_clip", ValueError, value("bbox_clip", math.nan)),
]

NMS_CASES = [
    ("boxes", ValueError, tensor_change("boxes", lambda t: t[0])),
    ("boxes", ValueError, tensor_change("boxes", lambda t: t[..., :3])),
    ("boxes", TypeError, tensor_change("boxes", lambda t: t.long())),
    ("scores", ValueError, tensor_change("scores", lambda t: t[:, :6])),
    ("scores", ValueError, tensor_change("scores", lambda t: t[0])),
    ("scores", TypeError, tensor_change("scores", lambda t: t.half())),
    ("labels", TypeError, tensor_change("labels", lambda t: t.int())),
    ("labels", ValueError, tensor_change("labels", lambda t: t[:1])),
    ("iou_threshold", ValueError, value("iou_threshold", math.nan)),
    ("max_detections", ValueError, value("max_detections", -1)),
]


def raised(function, args) -> tuple[type, str]:
    with pytest.raises((ValueError, TypeError)) as error:
        function(**args)
    return error.type, str(error.value)


@pytest.mark.parametrize("argument, kind, change", DECODE_CASES)
def test_decode_errors_name_the_argument(argument, kind, change):
    eager = raised(retinanet_decode, change(decode_args()))
    fake = raised(retinanet_decode, change(decode_args("meta")))
    assert eager[0] is kind and eager[1].startswith(f"{argument}: expected"), eager
    assert fake[0] is kind and fake[1].startswith(f"{argument}: expected"), fake


@pytest.mark.parametrize("argument, kind, change", NMS_CASES)
def test_nms_errors_name_the_argument(argument, kind, change):
    eager = raised(batched_nms, change(nms_args()))
    fake = raised(batched_nms, change(nms_args("meta")))
    assert fake == eager
    assert eager[0] is kind and eager[1].startswith(f"{argument}: expected"), eager


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_postprocess_checks_both_halves(device):
    args = {**decode_args(device), "iou_threshold": 0.5, "max_detections": 5}
    assert raised(retinanet_postprocess, {**args, "topk_candidates": -2})[1].startswith(
        "topk_candidates: expected"
    )
    assert raised(retinanet_postprocess, {**args, "max_detections": -1})[1].startswith(
        "max_detections: expected"
    )


def test_device_mismatch_names_the_argument():
    # One real device here: a meta tensor among CPU ones reaches the fake kernel's check.
    args = {**decode_args(), "image_sizes": torch.zeros(2, 2, dtype=torch.int64, device="meta")}
    assert raised(retinanet_decode, args) == (
        ValueError,
        "image_sizes: expected device cpu (the device of cls_logits), got meta",
    )
    args = {**nms_args("meta"), "labels": torch.zeros(2, 7, dtype=torch.int64)}
    assert (
        raised(batched_nms, args)[1]
        == "labels: expected device meta (the device of boxes), got cpu"
    )
