"""Custom operators for detection post-processing: ``torch.ops.bladesmith``.

One C++ definition per operator (``csrc/``) gives CPU and CUDA kernels, a copy-to-CPU
fallback for other devices (DirectML, MPS), registration visible to TorchScript, and fake
kernels for ``torch.compile`` and ``torch.export``. Outputs have fixed shapes: padded
tensors plus counts, never data-dependent sizes. Padding slots hold box 0, score 0 and
label -1.

The functions here build the library on first use (cached; see ``build.py``) and call
``torch.ops.bladesmith.*``. Code that is scripted with TorchScript calls
``torch.ops.bladesmith.*`` directly, after ``load_library()``; a saved TorchScript or
AOTInductor artifact needs only ``torch.ops.load_library(library_path())`` to load.

Importing this module is cheap: torch and the library are loaded on first use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bladesmith.ops.build import library_path, load_library

if TYPE_CHECKING:
    import torch

__all__ = [
    "BBOX_CLIP",
    "batched_nms",
    "exporting",
    "library_path",
    "load_builtin",
    "load_library",
    "multilevel_roi_align",
    "retinanet_decode",
    "retinanet_postprocess",
    "roi_align",
]

# torchvision's BoxCoder default: no box grows more than 1000/16 times its anchor.
BBOX_CLIP = math.log(1000.0 / 16)
_UNIT_WEIGHTS = (1.0, 1.0, 1.0, 1.0)


def _ops():
    import torch

    load_library()
    return torch.ops.bladesmith


def retinanet_decode(
    cls_logits: torch.Tensor,
    bbox_deltas: torch.Tensor,
    anchors: torch.Tensor,
    level_sizes: Sequence[int],
    image_sizes: torch.Tensor,
    score_threshold: float,
    topk_candidates: int,
    weights: Sequence[float] = _UNIT_WEIGHTS,
    bbox_clip: float = BBOX_CLIP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RetinaNet's candidate selection and box decoding, batched, before NMS.

    Per image and per level it equals torchvision's ``RetinaNet.postprocess_detections``
    up to NMS: sigmoid of the logits, scores above ``score_threshold``, the
    ``topk_candidates`` best, boxes decoded against their anchors with
    ``BoxCoder(weights, bbox_clip)`` and clipped to the image.

    Args:
        cls_logits: [B, N, C] float32, float16 or bfloat16 (bfloat16 on CUDA and CPU).
        bbox_deltas: [B, N, 4], same dtype and device.
        anchors: [N, 4] shared by the batch, or [B, N, 4] per image; same dtype.
        level_sizes: anchors per feature level, in the order of N; they sum to N.
        image_sizes: [B, 2] int64, (height, width) of each image, for clipping.
        score_threshold: candidates need a score strictly above it; NaN never passes.
        topk_candidates: at most this many candidates per image and level (>= 0).
        weights: (wx, wy, ww, wh) of the box coder.
        bbox_clip: upper bound of the width and height deltas before exp.

    Returns:
        boxes [B, K, 4], scores [B, K], labels [B, K] int64, with
        K = sum over levels of min(topk_candidates, N_l * C). Level l fills its own slots
        (after those of the levels before it) by descending score, ties by lower
        anchor * C + class; unused slots are padding (box 0, score 0, label -1).
    """
    return _ops().retinanet_decode(
        cls_logits,
        bbox_deltas,
        anchors,
        list(level_sizes),
        image_sizes,
        score_threshold,
        topk_candidates,
        list(weights),
        bbox_clip,
    )


def exporting() -> bool:
    """Whether torch is compiling or exporting to ONNX: where bladesmith's CPU-only
    kernels (winograd_conv3x3, roi_align_nhwc) give way to torch's and torchvision's
    operators, which every compiler and exporter knows."""
    import torch

    return torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def roi_align(
    features: torch.Tensor,
    rois: torch.Tensor,
    output_size: tuple[int, int],
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool = False,
) -> torch.Tensor:
    """``torchvision.ops.roi_align`` on ``rois`` [K, 5] (image index, box): [K, C, h, w].

    On a CPU, in float32 and outside compilation and ONNX export, ``roi_align_nhwc``: the
    same floats from the feature map in channels_last, vectorised over the channels and
    threaded over the boxes (torchvision's CPU kernel runs one channel and one box at a
    time). Elsewhere torchvision's operator. bfloat16 features, for which torchvision
    has no kernel on either device, are pooled in float32 and returned in bfloat16."""
    import torch
    from torchvision.ops import roi_align as torchvision_roi_align

    if features.dtype == torch.bfloat16:
        pooled = roi_align(
            features.float(), rois.float(), output_size, spatial_scale, sampling_ratio, aligned
        )
        return pooled.to(torch.bfloat16)
    if features.device.type == "cpu" and features.dtype == torch.float32 and not exporting():
        nhwc = features.contiguous(memory_format=torch.channels_last)
        height, width = output_size
        return _ops().roi_align_nhwc(
            nhwc, rois, spatial_scale, height, width, sampling_ratio, aligned
        )
    return torchvision_roi_align(
        features, rois, output_size, spatial_scale, sampling_ratio, aligned
    )


def multilevel_roi_align(
    table: torch.Tensor,
    rois: torch.Tensor,
    level_of: torch.Tensor,
    level_sizes: Sequence[tuple[int, int]],
    scales: Sequence[float],
    output_size: tuple[int, int],
    sampling_ratio: int,
) -> torch.Tensor:
    """torchvision's ``MultiScaleRoIAlign`` (``aligned=False``, ``sampling_ratio`` > 0) in
    one pass: box n of ``rois`` [N, 5] (image index, box; float32) pooled from level
    ``level_of[n]`` [N] at ``scales[level]``. ``table`` [B * P, C] holds every level's
    pixels channels last, image by image, the levels in order (``level_sizes``: each
    level's (height, width); P their pixels). Returns [N, h, w, C] in the table's dtype,
    torchvision's floats (mixed in float32)."""
    heights, widths = zip(*level_sizes)
    height, width = output_size
    return _ops().multilevel_roi_align(
        table,
        rois,
        level_of,
        list(heights),
        list(widths),
        list(scales),
        height,
        width,
        sampling_ratio,
    )


def batched_nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    labels: torch.Tensor,
    iou_threshold: float,
    max_detections: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Class-aware non-maximum suppression, batched, with fixed-size outputs.

    Per image it equals ``torchvision.ops.batched_nms`` (greedy by descending score; a box
    is dropped when its IoU with a kept box of the same label exceeds ``iou_threshold``)
    followed by ``[:max_detections]``. Entries with a negative label (padding) or a NaN
    score are ignored.

    Args:
        boxes: [B, K, 4] (x1, y1, x2, y2), float32, float16 or bfloat16.
        scores: [B, K], same dtype and device.
        labels: [B, K] int64.
        iou_threshold: suppression threshold on IoU.
        max_detections: D, the detections kept per image (>= 0).

    Returns:
        boxes [B, D, 4], scores [B, D], labels [B, D] int64 by descending score (ties by
        lower input slot), padded with box 0, score 0, label -1; and num_detections [B]
        int64.
    """
    return _ops().batched_nms(boxes, scores, labels, iou_threshold, max_detections)


def retinanet_postprocess(
    cls_logits: torch.Tensor,
    bbox_deltas: torch.Tensor,
    anchors: torch.Tensor,
    level_sizes: Sequence[int],
    image_sizes: torch.Tensor,
    score_threshold: float,
    topk_candidates: int,
    iou_threshold: float,
    max_detections: int,
    weights: Sequence[float] = _UNIT_WEIGHTS,
    bbox_clip: float = BBOX_CLIP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``retinanet_decode`` then ``batched_nms`` in one operator: per image, the same
    detections as torchvision's ``RetinaNet.postprocess_detections``.

    Arguments are those of the two operators (see them). A device may have a fused kernel;
    otherwise this runs the two operators in turn. It stays one node under
    ``torch.compile`` and ``torch.export``.

    Returns:
        boxes [B, D, 4], scores [B, D], labels [B, D] int64 (padded as ``batched_nms``),
        and num_detections [B] int64, with D = max_detections.
    """
    return _ops().retinanet_postprocess(
        cls_logits,
        bbox_deltas,
        anchors,
        list(level_sizes),
        image_sizes,
        score_threshold,
        topk_candidates,
        iou_threshold,
        max_detections,
        list(weights),
        bbox_clip,
    )


def load_builtin(torchvision: bool = True) -> Exception | None:
    """Load bladesmith's operator library, and (``torchvision``) torchvision's operators
    (RoIAlign, which R-CNN artifacts call) where torchvision is installed; the error if
    bladesmith's cannot be loaded (an artifact that needs no custom operator still loads)."""
    import contextlib
    import importlib

    from bladesmith.errors import OpsBuildError

    if torchvision:
        with contextlib.suppress(ImportError):
            importlib.import_module("torchvision")  # registers its operators

    try:
        load_library()
    except (ImportError, OpsBuildError) as error:
        return error
    return None
