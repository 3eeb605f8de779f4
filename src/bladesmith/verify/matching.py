"""One-to-one matching of boxes: greedy by IoU, same label."""

from __future__ import annotations

import numpy as np


def greedy_pairs(iou, eligible, order):
    """One-to-one pairs (i, j): each row i, in ``order``, takes the eligible column of
    highest IoU that no earlier row took. Consumes ``eligible``."""
    for i in order:
        row = np.where(eligible[i], iou[i], -1.0)
        j = int(row.argmax()) if row.size else -1
        if j >= 0 and row[j] >= 0:
            eligible[:, j] = False
            yield i, j


def matches(first, second, iou_threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Which detections of ``first`` and of ``second`` (each (boxes, labels)) match one
    another: same label, IoU at least ``iou_threshold``, one to one, greedily by overlap."""
    (boxes, labels), (other_boxes, other_labels) = first, second
    matched = np.zeros(len(boxes), dtype=bool)
    other_matched = np.zeros(len(other_boxes), dtype=bool)
    iou = box_iou(boxes, other_boxes)
    eligible = (labels[:, None] == other_labels[None, :]) & (iou >= iou_threshold)
    for i, j in greedy_pairs(iou, eligible, range(len(boxes))):
        matched[i] = other_matched[j] = True
    return matched, other_matched


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of [n, 4] and [m, 4] (x1, y1, x2, y2) boxes. Two boxes flattened onto one line
    (a detector clips a box past the image to its edge: x1 == x2 == width) have no
    area: theirs is the IoU of their segments on that line. Two identical points: 1."""
    size_a, size_b = (a[:, 2:] - a[:, :2]).clip(0), (b[:, 2:] - b[:, :2]).clip(0)
    high = np.minimum(a[:, None, 2:], b[None, :, 2:])
    overlap = (high - np.maximum(a[:, None, :2], b[None, :, :2])).clip(0)  # per axis
    inter = overlap.prod(axis=2)
    union = size_a.prod(axis=1)[:, None] + size_b.prod(axis=1)[None, :] - inter
    spans = size_a[:, None, :] + size_b[None, :, :] - overlap  # per axis
    for flat, along in ((0, 1), (1, 0)):
        on_line = (size_a[:, None, flat] == 0) & (size_b[None, :, flat] == 0)
        on_line &= a[:, None, flat] == b[None, :, flat]
        inter = np.where(on_line, overlap[..., along], inter)
        union = np.where(on_line, spans[..., along], union)
    identical = (a[:, None, :] == b[None, :, :]).all(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, inter / union, identical.astype(np.float64))
    return np.nan_to_num(iou, nan=0.0)
