"""The fields of a detection beyond its box, score and label, judged on matched pairs.

torchvision's Mask R-CNN adds "masks" [n, 1, H, W] (probabilities pasted into the
image), Keypoint R-CNN "keypoints" [n, K, 3] (x, y, visibility) and "keypoints_scores"
[n, K] (heatmap logits). Each is compared over the pairs that matching made, by a
measure whose tolerance follows what boxes and scores are allowed; a key with no
measure here is named as not verified (``unmeasured``), never passed in silence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from bladesmith.verify._format import finite_or_none, sci

# What detection matching itself compares.
MATCHED_KEYS = ("boxes", "scores", "labels")
# Pairs measured at once: pasted masks are a whole image each.
_CHUNK = 16


@dataclass
class FieldDeviation:
    """How far one measure of a field moved over the matched pairs (the worst pair),
    and how far it may."""

    name: str  # the measure: "masks", "keypoints", "keypoints visibility", ...
    tolerance: float
    deviation: float | None = None  # None: no matched pair

    @property
    def passed(self) -> bool:
        return self.deviation is None or self.deviation <= self.tolerance

    @property
    def tolerance_ratio(self) -> float:
        if not self.deviation:
            return 0.0
        return self.deviation / self.tolerance if self.tolerance > 0 else float("inf")

    def summary(self) -> str:
        return MEASURES[self.name].describe(self.deviation, self.tolerance)

    def to_dict(self) -> dict:
        return {
            "deviation": finite_or_none(self.deviation) if self.deviation is not None else None,
            "tolerance": self.tolerance,
            "passed": self.passed,
            "summary": self.summary(),
        }


@dataclass(frozen=True)
class _Measure:
    key: str  # the detection dict's key it reads
    # (reference rows, candidate rows, reference boxes [m, 4], probability band) ->
    # each pair's deviation [m]
    deviations: Callable
    # (iou_threshold, score_atol) -> the default tolerance
    default: Callable[[float, float], float]
    # (worst deviation or None, tolerance) -> a clause of the summary
    describe: Callable[[float | None, float], str]
    applies: Callable[[torch.Tensor], bool] = lambda reference: True


def _mask_deviations(ref, cand, boxes, band):
    """The pixels on the other side of 0.5 than the reference's, over its box's area
    (the scale the box itself is judged at: a mask's IoU would hold a small mask to a
    stricter standard than its box, where a paste moved by one pixel is a large part of
    it). A pixel within ``band`` (the dtype's score tolerance) of the reference counts on
    the reference's side: rounding alone flips it."""
    ref, cand = ref.flatten(1), cand.flatten(1)
    inside = ref > 0.5
    theirs = torch.where((cand - ref).abs() <= band, inside, cand > 0.5)
    area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).clamp(min=1)
    return (inside ^ theirs).sum(1) / area


def _keypoint_deviations(ref, cand, boxes, band):
    """The largest move of a keypoint (x or y) over its reference box's larger side."""
    size = (boxes[:, 2:] - boxes[:, :2]).amax(1).clamp(min=1)
    return _row_max((ref[..., :2] - cand[..., :2]).abs()) / size


def _visibility_deviations(ref, cand, boxes, band):
    return _row_max((ref[..., 2] - cand[..., 2]).abs())


def _keypoint_score_deviations(ref, cand, boxes, band):
    """Heatmap logits, unbounded: absolute up to 1, relative past it."""
    return _row_max((ref - cand).abs() / ref.abs().clamp(min=1))


# A box shifted by d along its side s keeps IoU (s - d) / (s + d): a keypoint may move
# as far, relative to its box, as the IoU threshold lets the box itself move, and a mask
# may change as many pixels as that shift changes of a box (2d of s, on each side).
def _box_shift(iou_threshold: float, score_atol: float) -> float:
    return (1 - iou_threshold) / (1 + iou_threshold)


MEASURES = {
    "masks": _Measure(
        "masks",
        _mask_deviations,
        lambda iou_threshold, score_atol: 2 * _box_shift(iou_threshold, score_atol),
        lambda dev, tol: (
            f"max mask dev {_percent(dev)} of its box's area at 0.5 (max {_percent(tol)})"
        ),
    ),
    "keypoints": _Measure(
        "keypoints",
        _keypoint_deviations,
        _box_shift,
        lambda dev, tol: (
            f"max keypoint dev {_percent(dev)} of its box's size (max {_percent(tol)})"
        ),
    ),
    "keypoints visibility": _Measure(
        "keypoints",
        _visibility_deviations,
        lambda iou_threshold, score_atol: 0.0,
        lambda dev, tol: f"max keypoint visibility dev {sci(dev)} (max {sci(tol)})",
        applies=lambda reference: reference.shape[-1] > 2,
    ),
    "keypoints_scores": _Measure(
        "keypoints_scores",
        _keypoint_score_deviations,
        lambda iou_threshold, score_atol: score_atol,
        lambda dev, tol: f"max keypoint score dev {sci(dev)} (atol {sci(tol)}, relative past 1)",
    ),
}


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.3g}%"


MEASURED_KEYS = tuple(dict.fromkeys(measure.key for measure in MEASURES.values()))


def unmeasured(detections: Mapping) -> list[str]:
    """The keys of one image's detections that nothing compares: neither matching nor
    a measure (or a measure's key whose value is not one row per detection)."""
    n = len(detections["scores"])
    return [
        str(key)
        for key, value in detections.items()
        if key not in MATCHED_KEYS and not (key in MEASURED_KEYS and _rows(value, n))
    ]


def _rows(value, n: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and len(value) == n


def measures_of(detections: Mapping) -> list[str]:
    """The measures (names in ``MEASURES``) that judge one image's ``detections``."""
    skipped = set(unmeasured(detections))
    return [
        name
        for name, measure in MEASURES.items()
        if measure.key in detections
        and measure.key not in skipped
        and measure.applies(detections[measure.key])
    ]


def measure_pairs(field: FieldDeviation, reference, candidate, pairs, band: float) -> str | None:
    """``field`` updated with the matched ``pairs`` ((reference, candidate) indices) of
    one image's detections: its worst deviation so far, infinite for a candidate row
    with NaN or inf. Returns why the candidate's field cannot be compared, if so."""
    measure = MEASURES[field.name]
    ref_value, cand_value = reference[measure.key], candidate[measure.key]
    if not _rows(cand_value, len(candidate["scores"])) or (
        cand_value.shape[1:] != ref_value.shape[1:]
    ):
        field.deviation = float("inf")
        shape = list(getattr(cand_value, "shape", [])) or type(cand_value).__name__
        return (
            f"{measure.key} is {shape}, where the reference's is "
            f"[n, {', '.join(map(str, ref_value.shape[1:]))}]"
        )
    if not pairs:
        return None
    ref_index = torch.tensor([i for i, _ in pairs])
    cand_index = torch.tensor([j for _, j in pairs])
    boxes = _as_float(reference["boxes"], ref_index)
    for start in range(0, len(pairs), _CHUNK):
        chunk = slice(start, start + _CHUNK)
        ref_rows = _as_float(ref_value, ref_index[chunk])
        cand_rows = _as_float(cand_value, cand_index[chunk])
        deviation = measure.deviations(ref_rows, cand_rows, boxes[chunk], band)
        finite = torch.isfinite(cand_rows.flatten(1)).all(1)
        worst = float(torch.where(finite, deviation, torch.inf).max())
        field.deviation = max(field.deviation or 0.0, worst)
    return None


def _row_max(values: torch.Tensor) -> torch.Tensor:
    """The largest of each row's (non-negative) values; 0 for an empty row."""
    return torch.cat([values.flatten(1), values.new_zeros(len(values), 1)], 1).amax(1)


def _as_float(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return value.detach()[index.to(value.device)].cpu().double()
