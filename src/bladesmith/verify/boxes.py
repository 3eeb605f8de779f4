"""Box tensors judged in pixels, by the IoU rule that matches detections.

A float tensor [..., 4] of (x1, y1, x2, y2) boxes, named like boxes or beside a tensor of
one value per box (scores, labels), is a detector's boxes whatever dtype computed them:
its tolerance is what the matching rule allows, never a multiple of its magnitude.

The bound. Along one axis, a box is an interval inside the image's side S. Two boxes of
sides (w, h) and (w', h') overlapping by (i, j) have IoU i j / (w h + w' h' - i j), at
most i / (w + w' - i), the overlap ratio of their intervals along x (as j <= h and
j <= h'), and likewise along y. Moving one end of an interval of length w by d leaves
a ratio of w / (w + d) outward, (w - d) / w inward; for either to stay at least t,
d <= S (1 - t) (inward, d <= w (1 - t); outward, d <= w (1 - t) / t with w + d <= S,
worst at w = S t).
So no coordinate moves more than S (1 - t) while its box keeps IoU >= t with its
reference: 160 px on a 320 px image at IoU 0.5, 32 px at 0.9. Each box row must also
keep IoU >= t with its own reference row (``row_ious``), the matching rule itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils import _pytree as pytree

# Channels of an image input: grey, RGB, RGBA; and the smallest side one has (a signal
# [1, 1, T] is not an image).
_IMAGE_CHANNELS = (1, 3, 4)
_IMAGE_SIDE = 8


@dataclass(frozen=True)
class BoxRule:
    """How far a box tensor's coordinates may move: IoU ``iou_threshold`` with each
    reference row, and no coordinate past ``ceiling`` (x, y) pixels."""

    iou_threshold: float
    ceiling: tuple[float, float]  # along x, along y
    source: str

    def per_coordinate(self) -> torch.Tensor:
        """The ceiling of (x1, y1, x2, y2), to broadcast over [..., 4]."""
        x, y = self.ceiling
        return torch.tensor([x, y, x, y], dtype=torch.float64)


def box_rule(reference: torch.Tensor, iou_threshold: float, image_size=None) -> BoxRule:
    """The rule for ``reference`` boxes under matching at ``iou_threshold``, in an image
    of ``image_size`` (width, height), or within the reference boxes' own extent where
    the image is unknown (which bounds every box the reference has)."""
    boxes = reference.detach().double().reshape(-1, 4)
    boxes = boxes[torch.isfinite(boxes).all(1)]
    # The span the boxes and the image cover along x and y (an unclipped box may lie
    # partly outside the image).
    low, high = [0.0, 0.0], list(image_size or (0.0, 0.0))
    if len(boxes):
        for axis in (0, 1):
            low[axis] = min(low[axis], float(boxes[:, axis::2].min()))
            high[axis] = max(high[axis], float(boxes[:, axis::2].max()))
    width, height = high[0] - low[0], high[1] - low[1]
    if image_size is not None:
        where = f"on a {_size(image_size)} image"
    else:
        where = f"within the reference boxes' extent ({_size((width, height))})"
    slack = 1 - iou_threshold
    ceiling = (width * slack, height * slack)
    limit = (
        f"{ceiling[0]:.3g} px"
        if ceiling[0] == ceiling[1]
        else f"{ceiling[0]:.3g} px (x), {ceiling[1]:.3g} px (y)"
    )
    return BoxRule(
        iou_threshold,
        ceiling,
        f"IoU {iou_threshold:g} rule {where}: a box keeps IoU >= {iou_threshold:g} with its "
        f"reference, a coordinate moves <= {limit}",
    )


def _size(size) -> str:
    return "x".join(f"{side:g}" for side in size)


def row_ious(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """The IoU of each box row with the same row of the other tensor (float64)."""
    a, b = reference.double().reshape(-1, 4), candidate.double().reshape(-1, 4)
    low, high = torch.maximum(a[:, :2], b[:, :2]), torch.minimum(a[:, 2:], b[:, 2:])
    inter = (high - low).clamp(min=0).prod(1)
    union = _area(a) + _area(b) - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-300), torch.zeros_like(union))


def _area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, 2:] - boxes[:, :2]).clamp(min=0).prod(1)


def has_area(boxes: torch.Tensor) -> torch.Tensor:
    """Which rows are boxes with an area (padding rows and points have none)."""
    return _area(boxes.double().reshape(-1, 4)) > 0


def looks_like_boxes(value, name, siblings: Sequence = ()) -> bool:
    """Whether ``value`` (a tensor or array) is a detector's boxes: floating point,
    [..., n, 4], every finite row with x1 <= x2 and y1 <= y2, and either named like
    boxes (``name`` holds "box") or beside a tensor of one value per box (``siblings``:
    the other values of its tuple, list or dict; a detector's scores or labels)."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        tensor = torch.from_numpy(value.astype(np.float64))
    elif isinstance(value, torch.Tensor):
        tensor = value
    else:
        return False
    if not (
        tensor.is_floating_point()
        and tensor.dim() >= 2
        and tensor.shape[-1] == 4
        and tensor.numel()
    ):
        return False
    rows = tensor.detach().reshape(-1, 4)
    rows = rows[torch.isfinite(rows).all(1)]
    if not bool(((rows[:, 2] >= rows[:, 0]) & (rows[:, 3] >= rows[:, 1])).all()):
        return False
    if isinstance(name, str) and "box" in name.lower():
        return True
    per_box = tuple(tensor.shape[:-1])
    return any(
        isinstance(other, torch.Tensor | np.ndarray) and tuple(other.shape) == per_box
        for other in siblings
    )


def largest_image_size(inputs) -> tuple[int, int] | None:
    """The (width, height) of the largest image among ``inputs`` (any structure): a
    floating-point tensor [..., C, H, W] with 1, 3 or 4 channels, H and W at least 8;
    None without one."""
    if inputs is None:
        return None
    leaves = pytree.tree_leaves(_plain(inputs))
    sizes = [
        (int(x.shape[-1]), int(x.shape[-2]))
        for x in leaves
        if isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dim() >= 3
        and x.shape[-3] in _IMAGE_CHANNELS
        and min(x.shape[-2:]) >= _IMAGE_SIDE
    ]
    if not sizes:
        return None
    return max(width for width, _ in sizes), max(height for _, height in sizes)


def _plain(tree):
    """Mappings of any kind as dicts, which pytree walks (a user's input may be one)."""
    if isinstance(tree, Mapping):
        return {key: _plain(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(value) for value in tree]
    return tree
