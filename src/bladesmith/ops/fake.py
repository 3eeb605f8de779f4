"""Fake (meta) kernels of torch.ops.bladesmith, for torch.compile and torch.export, and
the one statement of each operator's output shapes and dtypes (``output_types``): the
ONNX translations take theirs from here.

They compute output shapes from input shapes and arguments only, and mirror the input
checks of ``csrc/checks.h`` with the same messages, so a traced model fails as an eager
one would. Importing this module registers them; ``load_library()`` does so after loading
the operator library, and torch imports it by itself when tracing needs them (the C++
library names this module with ``set_python_module``).
"""

from __future__ import annotations

import math

import torch

from bladesmith.ops import BBOX_CLIP
from bladesmith.verify import dtype_name

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_LEVELS = 16  # kMaxLevels (csrc/roi_align_math.h)


def _check_rank(t: torch.Tensor, name: str, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {list(t.shape)}")


def _check_size(t, name: str, dim: int, expected, meaning: str, layout: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}: expected size {expected} ({meaning}) in dimension {dim} of {layout}, "
            f"got shape {list(t.shape)}"
        )


def _check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {dtype_name(t.dtype)}")


def _check_like(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    """Same dtype and device as ``ref``."""
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected dtype {dtype_name(ref.dtype)} (the dtype of {ref_name}), "
            f"got {dtype_name(t.dtype)}"
        )
    _check_device(t, name, ref, ref_name)


def _check_device(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(
            f"{name}: expected device {ref.device} (the device of {ref_name}), got {t.device}"
        )


def _check_int64(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype int64, got {dtype_name(t.dtype)}")


def _check_number(value: float, name: str) -> None:
    if math.isnan(value):
        raise ValueError(f"{name}: expected a number, got nan")


def _check_count(value: int, name: str) -> None:
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value}")


def check_decode_inputs(
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    score_threshold,
    topk_candidates,
    weights,
    bbox_clip,
):
    """checks.h's check_decode_inputs; returns K, the candidate slots per image."""
    _check_rank(cls_logits, "cls_logits", 3, "[B, N, C]")
    _check_float(cls_logits, "cls_logits")
    batch, num_anchors, num_classes = cls_logits.shape

    _check_rank(bbox_deltas, "bbox_deltas", 3, "[B, N, 4]")
    _check_size(bbox_deltas, "bbox_deltas", 0, batch, "B of cls_logits", "[B, N, 4]")
    _check_size(bbox_deltas, "bbox_deltas", 1, num_anchors, "N of cls_logits", "[B, N, 4]")
    _check_size(bbox_deltas, "bbox_deltas", 2, 4, "box coordinates", "[B, N, 4]")
    _check_like(bbox_deltas, "bbox_deltas", cls_logits, "cls_logits")

    if anchors.dim() not in (2, 3):
        raise ValueError(
            "anchors: expected a 2-D tensor [N, 4] or a 3-D tensor [B, N, 4], "
            f"got shape {list(anchors.shape)}"
        )
    per_image = anchors.dim() == 3
    layout = "[B, N, 4]" if per_image else "[N, 4]"
    if per_image:
        _check_size(anchors, "anchors", 0, batch, "B of cls_logits", layout)
    _check_size(anchors, "anchors", int(per_image), num_anchors, "N of cls_logits", layout)
    _check_size(anchors, "anchors", int(per_image) + 1, 4, "box coordinates", layout)
    _check_like(anchors, "anchors", cls_logits, "cls_logits")

    _check_rank(image_sizes, "image_sizes", 2, "[B, 2]")
    _check_size(image_sizes, "image_sizes", 0, batch, "B of cls_logits", "[B, 2]")
    _check_size(image_sizes, "image_sizes", 1, 2, "(height, width)", "[B, 2]")
    _check_int64(image_sizes, "image_sizes")
    _check_device(image_sizes, "image_sizes", cls_logits, "cls_logits")

    _check_number(score_threshold, "score_threshold")
    _check_count(topk_candidates, "topk_candidates")
    if len(weights) != 4:
        raise ValueError(f"weights: expected 4 values (wx, wy, ww, wh), got {len(weights)}")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"weights: expected finite positive values, got {list(weights)}")
    _check_number(bbox_clip, "bbox_clip")

    if any(n < 0 for n in level_sizes):
        raise ValueError(f"level_sizes: expected non-negative sizes, got {list(level_sizes)}")
    if sum(level_sizes) != num_anchors:
        raise ValueError(
            f"level_sizes: expected sizes that sum to N = {num_anchors} (dimension 1 of "
            f"cls_logits), got {list(level_sizes)} (sum {sum(level_sizes)})"
        )
    return sum(level_candidates(level_sizes, num_classes, topk_candidates))


def level_candidates(level_sizes, num_classes, topk_candidates) -> list:
    """The candidate slots of each level: its ``topk_candidates`` best (anchor, class)
    pairs, or all of them on a smaller level."""
    return [torch.sym_min(topk_candidates, n * num_classes) for n in level_sizes]


def check_nms_inputs(boxes, scores, labels, iou_threshold, max_detections) -> None:
    """checks.h's check_nms_inputs."""
    _check_rank(boxes, "boxes", 3, "[B, K, 4]")
    _check_size(boxes, "boxes", 2, 4, "box coordinates", "[B, K, 4]")
    _check_float(boxes, "boxes")
    batch, num_boxes = boxes.shape[:2]
    _check_rank(scores, "scores", 2, "[B, K]")
    _check_size(scores, "scores", 0, batch, "B of boxes", "[B, K]")
    _check_size(scores, "scores", 1, num_boxes, "K of boxes", "[B, K]")
    _check_like(scores, "scores", boxes, "boxes")
    _check_rank(labels, "labels", 2, "[B, K]")
    _check_size(labels, "labels", 0, batch, "B of boxes", "[B, K]")
    _check_size(labels, "labels", 1, num_boxes, "K of boxes", "[B, K]")
    _check_int64(labels, "labels")
    _check_device(labels, "labels", boxes, "boxes")
    _check_number(iou_threshold, "iou_threshold")
    _check_count(max_detections, "max_detections")


@torch.library.register_fake("bladesmith::retinanet_decode")
def retinanet_decode_fake(
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    score_threshold,
    topk_candidates,
    weights=(1.0, 1.0, 1.0, 1.0),
    bbox_clip=BBOX_CLIP,
):
    k = check_decode_inputs(
        cls_logits,
        bbox_deltas,
        anchors,
        level_sizes,
        image_sizes,
        score_threshold,
        topk_candidates,
        weights,
        bbox_clip,
    )
    batch = cls_logits.shape[0]
    return (
        cls_logits.new_empty((batch, k, 4)),
        cls_logits.new_empty((batch, k)),
        cls_logits.new_empty((batch, k), dtype=torch.int64),
    )


@torch.library.register_fake("bladesmith::batched_nms")
def batched_nms_fake(boxes, scores, labels, iou_threshold, max_detections):
    check_nms_inputs(boxes, scores, labels, iou_threshold, max_detections)
    batch = boxes.shape[0]
    return (
        boxes.new_empty((batch, max_detections, 4)),
        boxes.new_empty((batch, max_detections)),
        labels.new_empty((batch, max_detections)),
        labels.new_empty((batch,)),
    )


@torch.library.register_fake("bladesmith::retinanet_postprocess")
def retinanet_postprocess_fake(
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    score_threshold,
    topk_candidates,
    iou_threshold,
    max_detections,
    weights=(1.0, 1.0, 1.0, 1.0),
    bbox_clip=BBOX_CLIP,
):
    boxes, scores, labels = retinanet_decode_fake(
        cls_logits,
        bbox_deltas,
        anchors,
        level_sizes,
        image_sizes,
        score_threshold,
        topk_candidates,
        weights,
        bbox_clip,
    )
    return batched_nms_fake(boxes, scores, labels, iou_threshold, max_detections)


@torch.library.register_fake("bladesmith::conv2d_relu")
def conv2d_relu_fake(x, weight, bias, residual, stride, padding, dilation, groups):
    sizes = [x.shape[0], weight.shape[0]]
    for d in range(2):
        span = dilation[d] * (weight.shape[d + 2] - 1) + 1
        sizes.append((x.shape[d + 2] + 2 * padding[d] - span) // stride[d] + 1)
    if residual is not None and list(residual.shape) != sizes:
        raise RuntimeError(
            f"conv2d_relu: residual has shape {list(residual.shape)}, the convolution's "
            f"output {sizes}"
        )
    return x.new_empty(sizes).contiguous(memory_format=torch.channels_last)


def check_multilevel_roi_align_inputs(
    table, rois, level_of, heights, widths, scales, pooled_height, pooled_width, sampling_ratio
) -> int:
    """csrc/checks.h's checks of multilevel_roi_align; returns the rows of one image."""
    _check_rank(table, "table", 2, "[B * rows per image, C]")
    _check_float(table, "table")
    _check_rank(rois, "rois", 2, "[N, 5]")
    _check_size(rois, "rois", 1, 5, "image index and box", "[N, 5]")
    if rois.dtype != torch.float32:
        raise TypeError(f"rois: expected dtype float32, got {dtype_name(rois.dtype)}")
    _check_device(rois, "rois", table, "table")
    _check_rank(level_of, "level_of", 1, "[N]")
    _check_size(level_of, "level_of", 0, rois.shape[0], "N of rois", "[N]")
    _check_int64(level_of, "level_of")
    _check_device(level_of, "level_of", table, "table")
    if not 1 <= len(heights) <= _MAX_LEVELS:
        raise ValueError(f"heights: expected 1 to {_MAX_LEVELS} levels, got {len(heights)}")
    if len(widths) != len(heights) or len(scales) != len(heights):
        raise ValueError(
            f"widths, scales: expected one per level ({len(heights)}), got {len(widths)} "
            f"and {len(scales)}"
        )
    if pooled_height <= 0 or pooled_width <= 0:
        raise ValueError(
            "pooled_height, pooled_width: expected positive sizes, got "
            f"{pooled_height} and {pooled_width}"
        )
    if sampling_ratio <= 0:
        raise ValueError(f"sampling_ratio: expected a positive ratio, got {sampling_ratio}")
    if min(*heights, *widths) <= 0:
        raise ValueError(
            f"heights, widths: expected positive sizes, got {list(heights)} and {list(widths)}"
        )
    rows = sum(h * w for h, w in zip(heights, widths))
    if max(h * w for h, w in zip(heights, widths)) >= 2**63 or rows >= 2**63:
        raise ValueError(
            f"heights, widths: the levels' pixels overflow int64, got {list(heights)} and "
            f"{list(widths)}"
        )
    if table.shape[0] % rows != 0:
        raise ValueError(
            f"table: expected rows in whole images of {rows} (the levels' pixels), got "
            f"{table.shape[0]}"
        )
    return rows


@torch.library.register_fake("bladesmith::multilevel_roi_align")
def multilevel_roi_align_fake(
    table, rois, level_of, heights, widths, scales, pooled_height, pooled_width, sampling_ratio
):
    check_multilevel_roi_align_inputs(
        table, rois, level_of, heights, widths, scales, pooled_height, pooled_width, sampling_ratio
    )
    return table.new_empty((rois.shape[0], pooled_height, pooled_width, table.shape[1]))


FAKES = {
    "retinanet_decode": retinanet_decode_fake,
    "batched_nms": batched_nms_fake,
    "retinanet_postprocess": retinanet_postprocess_fake,
    "conv2d_relu": conv2d_relu_fake,
    "multilevel_roi_align": multilevel_roi_align_fake,
}


def output_types(op: str, *args) -> list[tuple[list[int], torch.dtype]]:
    """(shape, dtype) of each output of ``torch.ops.bladesmith.<op>(*args)``, tensors
    given as meta tensors (``torch.empty(shape, dtype=..., device="meta")``): its fake
    kernel's, which checks the arguments as the kernels do (ValueError, TypeError)."""
    outputs = FAKES[op](*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [(list(output.shape), output.dtype) for output in outputs]
