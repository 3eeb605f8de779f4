"""ONNX Runtime implementations of the bladesmith operators (``custom_ops="domain"``).

onnxruntime-extensions runs Python functions as operators of domain ``ai.onnx.contrib``;
each one here wraps the numpy inputs as tensors (no copy), calls the bladesmith CPU
kernel, and hands numpy back. Importing this module registers them;
``library_path()`` gives what ``SessionOptions.register_custom_ops_library`` needs.
Node layout (inputs, attributes) is the one ``bladesmith.onnx.symbolic`` exports.
"""

from __future__ import annotations

import numpy as np
import torch
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from bladesmith.onnx.symbolic import OP_TYPES

_F, _I = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64
_KINDS = {torch.float32: _F, torch.int64: _I}
# cls_logits, bbox_deltas, anchors, level_sizes, image_sizes, weights
_DECODE_INPUTS = [_F, _F, _F, _I, _I, _F]


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _outputs(op: str, *args) -> list:
    """The element types of the outputs of ``torch.ops.bladesmith.<op>(*args)`` for
    float32 inputs: its fake kernel's."""
    from bladesmith import ops

    ops.load_library()  # the fake kernels register on an operator the library defines
    from bladesmith.ops import fake

    return [_KINDS[dtype] for _, dtype in fake.output_types(op, *args)]


# The smallest calls: one image, one anchor of one class on one level; one box.
_LONG = torch.int64
_DECODE_CALL = (_meta(1, 1, 1), _meta(1, 1, 4), _meta(1, 4), [1], _meta(1, 2, dtype=_LONG), 0.0, 1)
_NMS_CALL = (_meta(1, 1, 4), _meta(1, 1), _meta(1, 1, dtype=_LONG), 0.5, 1)


def library_path() -> str:
    """The onnxruntime-extensions library that runs this module's operators, once the
    bladesmith kernels they call are loaded."""
    from bladesmith import ops

    ops.load_library()
    return get_library_path()


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _numpy(tensors) -> tuple[np.ndarray, ...]:
    return tuple(t.numpy() for t in tensors)


@onnx_op(
    op_type=OP_TYPES["retinanet_decode"],
    inputs=_DECODE_INPUTS,
    outputs=_outputs("retinanet_decode", *_DECODE_CALL),
    attrs={"score_threshold": _F, "topk_candidates": _I, "bbox_clip": _F},
)
def retinanet_decode(
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    weights,
    score_threshold,
    topk_candidates,
    bbox_clip,
):
    return _numpy(
        torch.ops.bladesmith.retinanet_decode(
            _tensor(cls_logits),
            _tensor(bbox_deltas),
            _tensor(anchors),
            level_sizes.tolist(),
            _tensor(image_sizes),
            score_threshold,
            topk_candidates,
            weights.tolist(),
            bbox_clip,
        )
    )


@onnx_op(
    op_type=OP_TYPES["batched_nms"],
    inputs=[_F, _F, _I],
    outputs=_outputs("batched_nms", *_NMS_CALL),
    attrs={"iou_threshold": _F, "max_detections": _I},
)
def batched_nms(boxes, scores, labels, iou_threshold, max_detections):
    return _numpy(
        torch.ops.bladesmith.batched_nms(
            _tensor(boxes), _tensor(scores), _tensor(labels), iou_threshold, max_detections
        )
    )


@onnx_op(
    op_type=OP_TYPES["retinanet_postprocess"],
    inputs=_DECODE_INPUTS,
    outputs=_outputs("retinanet_postprocess", *_DECODE_CALL, 0.5, 1),
    attrs={
        "score_threshold": _F,
        "topk_candidates": _I,
        "iou_threshold": _F,
        "max_detections": _I,
        "bbox_clip": _F,
    },
)
def retinanet_postprocess(
    cls_logits,
    bbox_deltas,
    anchors,
    level_sizes,
    image_sizes,
    weights,
    score_threshold,
    topk_candidates,
    iou_threshold,
    max_detections,
    bbox_clip,
):
    return _numpy(
        torch.ops.bladesmith.retinanet_postprocess(
            _tensor(cls_logits),
            _tensor(bbox_deltas),
            _tensor(anchors),
            level_sizes.tolist(),
            _tensor(image_sizes),
            score_threshold,
            topk_candidates,
            iou_threshold,
            max_detections,
            weights.tolist(),
            bbox_clip,
        )
    )
