"""ONNX translations of ``torch.ops.bladesmith`` for the TorchScript-based exporter.

Two modes, registered with ``torch.onnx.register_custom_op_symbolic`` for one export:

- ``"domain"``: each operator is one node in domain ``ai.onnx.contrib`` (op types in
  ``OP_TYPES``), run in ONNX Runtime by ``bladesmith.onnx.contrib_ops``. That domain is
  the one onnxruntime-extensions registers Python operators in, so the file runs as
  written, external data included, with no rewriting before the session. Python
  operators read scalar attributes only, so the list arguments travel as constant
  inputs: ``level_sizes`` (int64 [L]) and ``weights`` (float32 [4]).
- ``"standard"``: the operators are lowered to standard ONNX (TopK, Sigmoid, Gather,
  arithmetic, NonMaxSuppression, ScatterND) with the same fixed-shape outputs, so any
  ONNX Runtime provider and TensorRT can run the model; no If or Loop.

``multilevel_roi_align`` is lowered to standard operations (Gather and arithmetic, in
its kernels' order) in both modes.

Class-aware NMS: ``retinanet_postprocess`` knows the number of classes and gives
NonMaxSuppression one score plane per class, which is exactly torchvision's
``batched_nms`` (per-class NMS). A lone ``batched_nms`` cannot know it (labels are
data), so it runs one class on boxes offset by ``label * (coordinate span + 1)``:
torchvision's own trick under tracing, with the span (max - min, not max) so that
negative coordinates cannot make classes overlap. Rounding of the offset boxes in
float32 can still decide a pair whose IoU is within rounding of the threshold the
other way, as torchvision's trick can.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from bladesmith.errors import BladesmithError
from bladesmith.onnx.custom_nodes import DOMAIN, OP_TYPES

DOMAIN_VERSION = 1
MODES = ("domain", "standard")
MIN_OPSET = 13  # Unsqueeze/ReduceSum take axes as inputs from 13 on; the lowering uses that

_FLOAT32_LOWEST = float(torch.finfo(torch.float32).min)


class ExportShapeError(BladesmithError, ValueError):
    """An operator's input shape is unknown or inconsistent at export time."""


# ---------------------------------------------------------------------------- helpers


def _static_type(g, index: int, value, name: str) -> tuple[list[int], torch.dtype]:
    """Static sizes and dtype of the operator's input ``index`` (``value``).

    The traced node's types come first: the converted inputs may have lost their sizes
    to ONNX shape inference (torchvision's heads reshape with computed shapes). A
    TorchScript file has no traced sizes, but its converted inputs usually have them.
    """
    for value_type in (g.original_node.inputsAt(index).type(), value.type()):
        sizes = value_type.varyingSizes() if value_type.kind() == "TensorType" else None
        if sizes is not None and None not in sizes and value_type.dtype() is not None:
            return list(sizes), value_type.dtype()
    raise ExportShapeError(
        f"{name}: the exporter does not know its shape or dtype ({value.type()}); bladesmith "
        "operators export with static shapes only: export with example inputs of the "
        "final shape and no dynamic axes"
    )


def _const(g, values, dtype: torch.dtype):
    return g.op("Constant", value_t=torch.tensor(values, dtype=dtype))


def _unsqueeze(g, x, axis: int):
    return g.op("Unsqueeze", x, _const(g, [axis], torch.int64))


def _slice(g, x, start: int, end: int, axis: int):
    return g.op(
        "Slice",
        x,
        _const(g, [start], torch.int64),
        _const(g, [end], torch.int64),
        _const(g, [axis], torch.int64),
    )


def _reduce(g, op: str, x, axes: list[int], keepdims: int):
    # ReduceSum takes axes as an input from opset 13, ReduceMax/ReduceMin from 18.
    if op == "ReduceSum" or g.opset >= 18:
        return g.op(op, x, _const(g, axes, torch.int64), keepdims_i=keepdims)
    return g.op(op, x, axes_i=axes, keepdims_i=keepdims)


def _fake_types(g, op: str, args) -> list[tuple[list[int], torch.dtype]]:
    """(shape, dtype) of each output of ``torch.ops.bladesmith.<op>(*args)``: its fake
    kernel's (``ops.fake.output_types``, the one statement of its output shapes) on meta
    tensors of the node's static input types. Its checks, the kernels' own, raise
    ExportShapeError."""
    from bladesmith.ops import fake

    names = list(inspect.signature(fake.FAKES[op]).parameters)
    call = []
    for index, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch._C.Value):
            sizes, dtype = _static_type(g, index, value, name)
            value = torch.empty(sizes, dtype=dtype, device="meta")
        call.append(value)
    try:
        return fake.output_types(op, *call)
    except (ValueError, TypeError) as error:
        raise ExportShapeError(f"{op}: {error}") from error


def _set_types(g, outputs, types):
    # ONNX has no shape inference for custom-domain nodes: every translation's outputs
    # get the fake kernel's types (the lowerings' are the same, checked by the tests).
    like = g.original_node.inputsAt(0).type()
    outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    for output, (shape, dtype) in zip(outputs, types, strict=True):
        output.setType(like.with_dtype(dtype).with_sizes(shape))
    return outputs if len(outputs) > 1 else outputs[0]


@dataclass(frozen=True)
class _DecodeLayout:
    num_classes: int
    level_topk: list[int]  # candidates per level: min(topk, N_l * C)
    dtype: torch.dtype
    per_image_anchors: bool


def _decode_layout(g, cls_logits, anchors, level_sizes: list[int], topk: int) -> _DecodeLayout:
    """What the lowering needs of inputs the fake kernel has checked."""
    from bladesmith.ops.fake import level_candidates

    (_, _, num_classes), dtype = _static_type(g, 0, cls_logits, "cls_logits")
    level_topk = level_candidates(level_sizes, num_classes, topk)
    anchors_rank = len(_static_type(g, 2, anchors, "anchors")[0])
    return _DecodeLayout(num_classes, level_topk, dtype, anchors_rank == 3)


# ----------------------------------------------------------------------- domain mode


def _require_float32(dtype: torch.dtype, name: str) -> None:
    if dtype != torch.float32:
        raise BladesmithError(
            f"custom_ops='domain' runs the operators through float32 implementations in "
            f"ONNX Runtime, but {name} is {dtype}: export the float32 model, or use "
            "custom_ops='standard'"
        )


def _decode_domain_node(g, op, inputs, level_sizes, weights, outputs, **attributes):
    cls_logits, bbox_deltas, anchors, image_sizes = inputs
    return g.op(
        f"{DOMAIN}::{OP_TYPES[op]}",
        cls_logits,
        bbox_deltas,
        anchors,
        _const(g, level_sizes, torch.int64),
        image_sizes,
        _const(g, weights, torch.float32),
        outputs=outputs,
        **attributes,
    )


def _decode_domain(
    g,
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
    _require_float32(_static_type(g, 0, cls_logits, "cls_logits")[1], "cls_logits")
    return _decode_domain_node(
        g,
        "retinanet_decode",
        (cls_logits, bbox_deltas, anchors, image_sizes),
        level_sizes,
        weights,
        3,
        score_threshold_f=score_threshold,
        topk_candidates_i=topk_candidates,
        bbox_clip_f=bbox_clip,
    )


def _nms_domain(g, boxes, scores, labels, iou_threshold, max_detections):
    _require_float32(_static_type(g, 0, boxes, "boxes")[1], "boxes")
    return g.op(
        f"{DOMAIN}::{OP_TYPES['batched_nms']}",
        boxes,
        scores,
        labels,
        iou_threshold_f=iou_threshold,
        max_detections_i=max_detections,
        outputs=4,
    )


def _postprocess_domain(
    g,
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    score_threshold,
    topk_candidates,
    iou_threshold,
    max_detections,
    weights,
    bbox_clip,
):
    _require_float32(_static_type(g, 0, cls_logits, "cls_logits")[1], "cls_logits")
    return _decode_domain_node(
        g,
        "retinanet_postprocess",
        (cls_logits, bbox_deltas, anchors, image_sizes),
        level_sizes,
        weights,
        4,
        score_threshold_f=score_threshold,
        topk_candidates_i=topk_candidates,
        iou_threshold_f=iou_threshold,
        max_detections_i=max_detections,
        bbox_clip_f=bbox_clip,
    )


# --------------------------------------------------------------------- standard mode


def _decode_boxes(g, deltas, anchors, weights, bbox_clip):
    """torchvision's BoxCoder.decode_single on float32 [B, K, 4], operation by operation,
    as the kernels do it."""

    def column(x, i):
        return _slice(g, x, i, i + 1, 2)

    def c(value):
        return _const(g, value, torch.float32)

    x1, y1, x2, y2 = (column(anchors, i) for i in range(4))
    widths = g.op("Sub", x2, x1)
    heights = g.op("Sub", y2, y1)
    ctr_x = g.op("Add", x1, g.op("Mul", c(0.5), widths))
    ctr_y = g.op("Add", y1, g.op("Mul", c(0.5), heights))
    wx, wy, ww, wh = weights
    dx = g.op("Div", column(deltas, 0), c(wx))
    dy = g.op("Div", column(deltas, 1), c(wy))
    dw = g.op("Min", g.op("Div", column(deltas, 2), c(ww)), c(bbox_clip))
    dh = g.op("Min", g.op("Div", column(deltas, 3), c(wh)), c(bbox_clip))
    pred_ctr_x = g.op("Add", g.op("Mul", dx, widths), ctr_x)
    pred_ctr_y = g.op("Add", g.op("Mul", dy, heights), ctr_y)
    half_w = g.op("Mul", c(0.5), g.op("Mul", g.op("Exp", dw), widths))
    half_h = g.op("Mul", c(0.5), g.op("Mul", g.op("Exp", dh), heights))
    return (
        g.op("Sub", pred_ctr_x, half_w),
        g.op("Sub", pred_ctr_y, half_h),
        g.op("Add", pred_ctr_x, half_w),
        g.op("Add", pred_ctr_y, half_h),
    )


def _cast(g, x, dtype: torch.dtype, current: torch.dtype):
    return x if dtype == current else g.op("Cast", x, to_i=_onnx_type(dtype))


def _decode_standard(
    g,
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
    """Like the kernels: float32 arithmetic, scores rounded to the input dtype, per level
    the top K scores over the threshold, ties to the lower (anchor, class) index."""
    layout = _decode_layout(g, cls_logits, anchors, level_sizes, topk_candidates)
    num_classes, dtype, f32 = layout.num_classes, layout.dtype, torch.float32
    scores, positions = [], []
    offset = 0
    for size, k in zip(level_sizes, layout.level_topk, strict=True):
        if k:
            flat = g.op(
                "Reshape",
                _slice(g, cls_logits, offset, offset + size, 1),
                _const(g, [0, -1], torch.int64),
            )
            level = g.op("Sigmoid", _cast(g, flat, f32, dtype))
            level = _cast(g, _cast(g, level, dtype, f32), f32, dtype)
            top, index = g.op(
                "TopK",
                level,
                _const(g, [k], torch.int64),
                axis_i=1,
                largest_i=1,
                sorted_i=1,
                outputs=2,
            )
            scores.append(top)
            positions.append(g.op("Add", index, _const(g, offset * num_classes, torch.int64)))
        offset += size
    if not scores:
        raise ExportShapeError(
            f"retinanet_decode: no candidates to export (topk_candidates={topk_candidates}, "
            f"level_sizes={level_sizes}); use topk_candidates >= 1 and non-empty levels"
        )
    score = g.op("Concat", *scores, axis_i=1)
    position = g.op("Concat", *positions, axis_i=1)
    classes = _const(g, num_classes, torch.int64)
    anchor_index = g.op("Div", position, classes)
    labels = g.op("Sub", position, g.op("Mul", anchor_index, classes))

    gather_index = _unsqueeze(g, anchor_index, 2)
    deltas = g.op("GatherND", bbox_deltas, gather_index, batch_dims_i=1)
    if layout.per_image_anchors:
        anchor_boxes = g.op("GatherND", anchors, gather_index, batch_dims_i=1)
    else:
        anchor_boxes = g.op("Gather", anchors, anchor_index, axis_i=0)
    x1, y1, x2, y2 = _decode_boxes(
        g, _cast(g, deltas, f32, dtype), _cast(g, anchor_boxes, f32, dtype), weights, bbox_clip
    )

    # clip_boxes_to_image: x in [0, width], y in [0, height], per image.
    hw = _unsqueeze(g, g.op("Cast", image_sizes, to_i=_onnx_type(f32)), 1)  # [B, 1, 2]
    height, width = _slice(g, hw, 0, 1, 2), _slice(g, hw, 1, 2, 2)
    zero = _const(g, 0.0, f32)
    boxes = g.op(
        "Concat",
        *(
            g.op("Min", g.op("Max", v, zero), limit)
            for v, limit in ((x1, width), (y1, height), (x2, width), (y2, height))
        ),
        axis_i=2,
    )
    # The threshold rounded to the input dtype, as a comparison with a Python float does.
    threshold = float(torch.tensor(score_threshold, dtype=dtype))
    valid = g.op("Greater", score, _const(g, threshold, f32))
    return (
        _cast(g, g.op("Where", _unsqueeze(g, valid, 2), boxes, zero), dtype, f32),
        _cast(g, g.op("Where", valid, score, zero), dtype, f32),
        g.op("Where", valid, labels, _const(g, -1, torch.int64)),
    )


def _onnx_type(dtype: torch.dtype) -> int:
    from onnx import TensorProto

    types = {
        torch.float32: TensorProto.FLOAT,
        torch.float16: TensorProto.FLOAT16,
        torch.bfloat16: TensorProto.BFLOAT16,
        torch.float64: TensorProto.DOUBLE,
        torch.int64: TensorProto.INT64,
    }
    return types[dtype]


def _batched_nms_standard(g, boxes, scores, labels, iou_threshold, max_detections):
    (_, num_candidates, _), dtype = _static_type(g, 0, boxes, "boxes")
    return _nms_standard(
        g, boxes, scores, labels, iou_threshold, max_detections, num_candidates, dtype
    )


def _nms_standard(
    g,
    boxes,
    scores,
    labels,
    iou_threshold,
    max_detections,
    num_candidates: int,
    dtype: torch.dtype,
    num_classes: int | None = None,
):
    """Class-aware NMS with padded outputs: per-class score planes when ``num_classes``
    is known, the coordinate offset otherwise (see the module docstring)."""
    f32 = torch.float32
    as_float = _cast(g, boxes, f32, dtype)
    float_scores = _cast(g, scores, f32, dtype)
    if not 0.0 <= iou_threshold <= 1.0:
        raise BladesmithError(
            f"iou_threshold: ONNX's NonMaxSuppression takes values in [0, 1], got "
            f"{iou_threshold}; use custom_ops='domain' for other values"
        )
    minus_inf = _const(g, float("-inf"), torch.float32)
    lowest = _const(g, [_FLOAT32_LOWEST], torch.float32)

    if num_classes is not None:
        classes = _const(g, list(range(num_classes)), torch.int64)
        in_class = g.op("Equal", _unsqueeze(g, labels, 1), _unsqueeze(g, classes, 1))
        planes = g.op("Where", in_class, _unsqueeze(g, float_scores, 1), minus_inf)
        nms_boxes = as_float
    else:
        valid = g.op("Greater", labels, _const(g, -1, torch.int64))  # padding has label -1
        planes = _unsqueeze(g, g.op("Where", valid, float_scores, minus_inf), 1)
        masked = g.op("Where", _unsqueeze(g, valid, 2), as_float, _const(g, 0.0, torch.float32))
        span = g.op(
            "Add",
            g.op(
                "Sub",
                _reduce(g, "ReduceMax", masked, [1, 2], 1),
                _reduce(g, "ReduceMin", masked, [1, 2], 1),
            ),
            _const(g, 1.0, torch.float32),
        )
        label_offset = g.op(
            "Mul", _unsqueeze(g, g.op("Cast", labels, to_i=_onnx_type(torch.float32)), 2), span
        )
        nms_boxes = g.op("Add", masked, label_offset)

    selected = g.op(
        "NonMaxSuppression",
        nms_boxes,
        planes,
        _const(g, [max_detections], torch.int64),
        _const(g, [iou_threshold], torch.float32),
        lowest,  # keeps every finite score; -inf marks "not in this class" or padding
        center_point_box_i=0,
    )
    # [S, 3] (batch, class, box) -> a dense [B, K] of kept scores, -inf elsewhere, whose
    # TopK gives the best max_detections in descending order with static shapes.
    batch_and_box = g.op("Gather", selected, _const(g, [0, 2], torch.int64), axis_i=1)
    kept = g.op(
        "ScatterND",
        g.op(
            "ConstantOfShape",
            g.op("Shape", float_scores),
            value_t=torch.tensor([float("-inf")], dtype=torch.float32),
        ),
        batch_and_box,
        g.op("GatherND", float_scores, batch_and_box),
    )
    k = min(max_detections, num_candidates)
    top, index = g.op(
        "TopK", kept, _const(g, [k], torch.int64), axis_i=1, largest_i=1, sorted_i=1, outputs=2
    )
    chosen = g.op("Greater", top, lowest)
    zero = _const(g, 0.0, dtype)
    out_boxes = g.op(
        "Where",
        _unsqueeze(g, chosen, 2),
        g.op("GatherND", boxes, _unsqueeze(g, index, 2), batch_dims_i=1),
        zero,
    )
    out_scores = g.op("Where", chosen, g.op("GatherElements", scores, index, axis_i=1), zero)
    out_labels = g.op(
        "Where",
        chosen,
        g.op("GatherElements", labels, index, axis_i=1),
        _const(g, -1, torch.int64),
    )
    count = _reduce(g, "ReduceSum", g.op("Cast", chosen, to_i=_onnx_type(torch.int64)), [1], 0)
    if k < max_detections:  # fewer candidates than slots: pad along the detection axis
        extra = max_detections - k
        out_boxes = _pad(g, out_boxes, extra, 3, zero)
        out_scores = _pad(g, out_scores, extra, 2, zero)
        out_labels = _pad(g, out_labels, extra, 2, _const(g, -1, torch.int64))
    return out_boxes, out_scores, out_labels, count


def _pad(g, x, extra: int, rank: int, value):
    pads = [0] * (2 * rank)
    pads[rank + 1] = extra  # the end of axis 1
    return g.op("Pad", x, _const(g, pads, torch.int64), value, mode_s="constant")


def _postprocess_standard(
    g,
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    score_threshold,
    topk_candidates,
    iou_threshold,
    max_detections,
    weights,
    bbox_clip,
):
    boxes, scores, labels = _decode_standard(
        g,
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
    layout = _decode_layout(g, cls_logits, anchors, level_sizes, topk_candidates)
    return _nms_standard(
        g,
        boxes,
        scores,
        labels,
        iou_threshold,
        max_detections,
        sum(layout.level_topk),
        layout.dtype,
        layout.num_classes,
    )


def _multilevel_roi_align(
    g, table, rois, level_of, heights, widths, scales, pooled_height, pooled_width, grid
):
    """``multilevel_roi_align`` as standard operations in either mode: the arithmetic of
    its kernels (``csrc/roi_align_math.h``), operation by operation (each box's level
    constants gathered by its level, its samples' four neighbours gathered from the table,
    weighted and summed in torchvision's order), [N, h, w, C] in the table's dtype. Boxes
    must name levels and images of the table (the kernels pool others to 0)."""
    (_, channels), dtype = _static_type(g, 0, table, "table")
    (count, _), _ = _static_type(g, 1, rois, "rois")

    def c(value, kind=torch.float32):
        return _const(g, value, kind)

    def per_box(values, kind=torch.float32):  # [N, 1]
        return _unsqueeze(g, g.op("Gather", c(values, kind), level_of, axis_i=0), 1)

    def stack(low, high):  # [..., 2]
        return g.op("Concat", _unsqueeze(g, low, -1), _unsqueeze(g, high, -1), axis_i=-1)

    def samples(start, end, bins):  # [N, bins * grid]: roi::sample_at of each bin
        bin_size = g.op("Div", g.op("Max", g.op("Sub", end, start), c(1.0)), c(float(bins)))
        bin_start = g.op("Add", start, g.op("Mul", c([list(map(float, range(bins)))]), bin_size))
        offset = c([[[i + 0.5 for i in range(grid)]]])
        step = g.op("Div", g.op("Mul", offset, _unsqueeze(g, bin_size, 2)), c(float(grid)))
        positions = g.op("Add", _unsqueeze(g, bin_start, 2), step)
        return g.op("Reshape", positions, c([count, bins * grid], torch.int64))

    def neighbours(position, size):  # roi::bilinear's, weights 0 outside
        inside = g.op(
            "And",
            g.op("GreaterOrEqual", position, c(-1.0)),
            g.op("LessOrEqual", position, size),
        )
        position = g.op("Max", position, c(0.0))
        low = g.op("Floor", position)
        last = g.op("Sub", size, c(1.0))
        at_edge = g.op("GreaterOrEqual", low, last)
        low = g.op("Where", at_edge, last, low)
        high = g.op("Where", at_edge, last, g.op("Add", low, c(1.0)))
        fraction = g.op("Sub", g.op("Where", at_edge, low, position), low)
        inside = g.op("Cast", inside, to_i=_onnx_type(torch.float32))
        low_weight = g.op("Mul", g.op("Sub", c(1.0), fraction), inside)
        as_int = [g.op("Cast", x, to_i=_onnx_type(torch.int64)) for x in (low, high)]
        return (*as_int, low_weight, g.op("Mul", fraction, inside))

    offsets = [0]
    for height, width in zip(heights, widths):
        offsets.append(offsets[-1] + height * width)
    height, width = per_box([float(h) for h in heights]), per_box([float(w) for w in widths])
    scale = per_box([float(x) for x in scales])
    image = g.op("Cast", _slice(g, rois, 0, 1, 1), to_i=_onnx_type(torch.int64))
    first_row = g.op(
        "Add", per_box(offsets[:-1], torch.int64), g.op("Mul", image, c(offsets[-1], torch.int64))
    )
    x1, y1, x2, y2 = (g.op("Mul", _slice(g, rois, i, i + 1, 1), scale) for i in range(1, 5))
    y_low, y_high, wy_low, wy_high = neighbours(samples(y1, y2, pooled_height), height)
    x_low, x_high, wx_low, wx_high = neighbours(samples(x1, x2, pooled_width), width)
    width_rows = _unsqueeze(g, g.op("Cast", width, to_i=_onnx_type(torch.int64)), 2)
    row_y = g.op("Mul", stack(y_low, y_high), width_rows)  # [N, Y, 2]
    index = g.op(
        "Add",
        g.op("Add", g.op("Reshape", first_row, c([count, 1, 1, 1, 1], torch.int64)),
             g.op("Unsqueeze", row_y, c([3, 4], torch.int64))),
        g.op("Unsqueeze", stack(x_low, x_high), c([1, 2], torch.int64)),
    )  # fmt: skip
    values = g.op("Gather", table, g.op("Reshape", index, c([-1], torch.int64)), axis_i=0)
    values = _cast(g, values, torch.float32, dtype)
    shape = [count, pooled_height, grid, 2, pooled_width, grid, 2, channels]
    values = g.op("Reshape", values, c(shape, torch.int64))
    weight_y = g.op(
        "Reshape", stack(wy_low, wy_high), c([count, pooled_height, grid, 2, 1, 1], torch.int64)
    )
    weight_x = g.op(
        "Reshape", stack(wx_low, wx_high), c([count, 1, pooled_width, grid, 2, 1], torch.int64)
    )

    def pick(x, *at):  # x[..., at[0], at[1], ...] on the axes given, each axis then dropped
        for axis, index in at:
            x = g.op("Gather", x, c(index, torch.int64), axis_i=axis)
        return x

    total = None
    for iy in range(grid):
        for ix in range(grid):
            sample = None
            for y, x in ((0, 0), (0, 1), (1, 0), (1, 1)):
                weight = g.op(
                    "Mul", pick(weight_y, (2, iy), (2, y)), pick(weight_x, (3, ix), (3, x))
                )
                term = g.op("Mul", weight, pick(values, (2, iy), (2, y), (3, ix), (3, x)))
                sample = term if sample is None else g.op("Add", sample, term)
            total = sample if total is None else g.op("Add", total, sample)
    pooled = g.op("Div", total, c(float(grid * grid)))
    return _cast(g, pooled, dtype, torch.float32)


# ----------------------------------------------------------------------- registration

_DECODE_ARGS = ("v", "v", "v", "is", "v", "f", "i", "fs", "f")
_NMS_ARGS = ("v", "v", "v", "f", "i")
_POSTPROCESS_ARGS = ("v", "v", "v", "is", "v", "f", "i", "f", "i", "fs", "f")
_POOL_ARGS = ("v", "v", "v", "is", "is", "fs", "i", "i", "i")

_SYMBOLICS = {
    "domain": {
        "retinanet_decode": (_decode_domain, _DECODE_ARGS),
        "batched_nms": (_nms_domain, _NMS_ARGS),
        "retinanet_postprocess": (_postprocess_domain, _POSTPROCESS_ARGS),
        # Standard operations in this mode too: ONNX Runtime's own kernels pool faster
        # than a Python operator would.
        "multilevel_roi_align": (_multilevel_roi_align, _POOL_ARGS),
    },
    "standard": {
        "retinanet_decode": (_decode_standard, _DECODE_ARGS),
        "batched_nms": (_batched_nms_standard, _NMS_ARGS),
        "retinanet_postprocess": (_postprocess_standard, _POSTPROCESS_ARGS),
        "multilevel_roi_align": (_multilevel_roi_align, _POOL_ARGS),
    },
}


# The bladesmith operators "standard" mode lowers to standard ONNX, by name.
LOWERED_TO_STANDARD = frozenset(_SYMBOLICS["standard"])


def check_mode(custom_ops: str, opset: int) -> None:
    if custom_ops not in MODES:
        raise BladesmithError(
            f"custom_ops must be one of {', '.join(repr(m) for m in MODES)}; got {custom_ops!r}"
        )
    if opset < MIN_OPSET:
        raise BladesmithError(
            f"opset {opset} is too old for the bladesmith operators: use opset >= {MIN_OPSET}"
        )


def _translation(op: str, function, kinds):
    """``function`` as the exporter calls it: arguments parsed as ``kinds`` say, the
    fake kernel's checks first, its output types on the outputs."""
    from torch.onnx import symbolic_helper  # slow to import: only while exporting

    def translate(g, *values):
        # parse_args(*kinds) would do this, but it zips with the function's named
        # parameters, of which this one has none.
        args = [
            value if kind == "v" else symbolic_helper._parse_arg(value, kind)
            for value, kind in zip(values, kinds)
        ]
        types = _fake_types(g, op, args)
        return _set_types(g, function(g, *args), types)

    return translate


@contextlib.contextmanager
def registered(custom_ops: str, opset: int) -> Iterator[None]:
    """Register the translations of ``custom_ops`` mode for one export, then remove them."""
    check_mode(custom_ops, opset)
    import torch.onnx

    names = []
    try:
        for op, (function, kinds) in _SYMBOLICS[custom_ops].items():
            name = f"bladesmith::{op}"
            torch.onnx.register_custom_op_symbolic(name, _translation(op, function, kinds), opset)
            names.append(name)
        yield
    finally:
        for name in names:
            torch.onnx.unregister_custom_op_symbolic(name, opset)
