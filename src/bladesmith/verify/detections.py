"""Detections compared without regard to order, matched by class and IoU.

Detections are a list, one per image, of dicts with "boxes" [n, 4], "scores" [n] and
"labels" [n], and any fields of their own (masks, keypoints: ``verify.fields``, compared
on the matched pairs). Two equally correct detectors may emit the same boxes in another
order, and NMS ties may resolve differently: what rounding alone explains is excused
(``verify.ties``), and counted. Labels match exactly (float labels must be whole
numbers); a matched box keeps IoU >= the threshold, which bounds how far its
coordinates move in the image (``verify.boxes``), as the summary says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from bladesmith.verify._format import finite_or_none, ratio, sci
from bladesmith.verify.boxes import box_rule
from bladesmith.verify.fields import (
    MATCHED_KEYS,
    MEASURES,
    FieldDeviation,
    measure_pairs,
    measures_of,
    unmeasured,
)
from bladesmith.verify.matching import box_iou, greedy_pairs
from bladesmith.verify.ties import excuse
from bladesmith.verify.tolerance import default_tolerance, detection_score_rule


@dataclass
class DetectionComparison:
    """Detections matched one-to-one by class and IoU, over all images."""

    passed: bool
    iou_threshold: float
    min_f1: float
    score_atol: float
    images: int = 0
    reference_count: int = 0
    candidate_count: int = 0
    matched: int = 0
    precision: float = 1.0
    recall: float = 1.0
    f1: float = 1.0
    max_box_deviation: float | None = None  # largest coordinate difference, in pixels
    max_score_deviation: float | None = None
    mean_iou: float | None = None
    excused: int = 0  # unmatched on a near tie or a rounding flip (or their consequences)
    strict_f1: float = 1.0  # F1 with nothing excused
    # The other fields (masks, keypoints, ...) over the matched pairs, by measure
    fields: dict[str, FieldDeviation] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)  # fields nothing compares
    tolerance_ratio: float = 0.0  # worst of the F1 shortfall and each deviation, as above
    reasons: list[str] = field(default_factory=list)
    box_ceiling: float | None = None  # px: the most the IoU rule lets a coordinate move
    source: str = ""  # where the box and score tolerances come from

    def summary(self) -> str:
        text = (
            f"F1 {self.f1:.4g} (min {self.min_f1:g}), {self.matched} matched of "
            f"{self.reference_count} reference / {self.candidate_count} candidate"
            + (
                f" ({self.excused} on near ties or rounding flips excused; "
                f"strict F1 {self.strict_f1:.4g}), "
                if self.excused
                else ", "
            )
            + f"max box dev {sci(self.max_box_deviation)} px"
            + (f" (IoU rule: <= {sci(self.box_ceiling)} px), " if self.box_ceiling else ", ")
            + f"max score dev {sci(self.max_score_deviation)} (atol {sci(self.score_atol)})"
            + "".join(f", {each.summary()}" for each in self.fields.values())
        )
        if self.unverified:
            text += f"; not verified: {', '.join(map(repr, self.unverified))} (no measure)"
        return "; ".join([*self.reasons, text])

    def to_dict(self) -> dict:
        return {
            "kind": "detections",
            "passed": self.passed,
            "summary": self.summary(),
            "iou_threshold": self.iou_threshold,
            "min_f1": self.min_f1,
            "score_atol": self.score_atol,
            "images": self.images,
            "reference_count": self.reference_count,
            "candidate_count": self.candidate_count,
            "matched": self.matched,
            "excused": self.excused,
            "precision": self.precision,
            "recall": self.recall,
            "f1": self.f1,
            "strict_f1": self.strict_f1,
            "max_box_deviation": self.max_box_deviation,
            "max_score_deviation": self.max_score_deviation,
            "mean_iou": self.mean_iou,
            "fields": {name: each.to_dict() for name, each in self.fields.items()},
            "unverified": list(self.unverified),
            "tolerance_ratio": finite_or_none(self.tolerance_ratio),
            "reasons": list(self.reasons),
            "box_ceiling": self.box_ceiling,
            "source": self.source,
        }


def is_detection_list(value) -> bool:
    """Whether ``value`` is a non-empty list of {"boxes", "scores", "labels"} dicts."""
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(item, Mapping) and set(MATCHED_KEYS) <= set(item) for item in value)
    )


def contains_detections(value) -> bool:
    """Whether ``value`` (any structure of outputs) holds a detection list."""
    if is_detection_list(value):
        return True
    if isinstance(value, Mapping):
        return any(contains_detections(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_detections(item) for item in value)
    return False


def compare_detections(
    reference,
    candidate,
    iou_threshold=0.9,
    min_f1=0.99,
    score_atol=None,
    tie_iou=0.5,
    noisy=(),
    field_tolerances=None,
    image_size=None,
) -> DetectionComparison:
    """Match candidate detections to reference ones, order-free, and score the match.

    Per image, reference detections are taken by descending score; each is matched to
    the unmatched candidate of the same label with the highest IoU, if that IoU is at
    least ``iou_threshold``. Precision, recall and F1 count over all images; box and
    score deviations are the largest over matched pairs. Passes when F1 >= ``min_f1``
    and no matched score moved by more than ``score_atol``, which defaults to
    ``detection_score_tolerance`` of the scores' dtype (5e-3 for float32).
    Candidates with NaN or inf in a box or score match nothing.

    A detector's list is cut at a score: its threshold, or the lowest score kept when
    it keeps at most so many detections per image. A detection scoring within
    ``score_atol`` of the other list's lowest score may fall on either side of the cut
    after any rounding change: unmatched pairs of such detections, one from each list,
    are excused (counted in ``excused``), not counted against precision or recall.
    Likewise greedy NMS keeps one of two overlapping boxes of a class by score: when
    they overlap by at least ``tie_iou`` (torchvision detectors' NMS threshold) and
    score that close, either choice is right, and such an unmatched pair is excused too.
    So is what follows from it: the box kept instead suppresses other neighbours, so an
    unmatched detection overlapping an excused one of the other list by ``tie_iou``
    (same class) is excused as well, and so on along such a chain of overlapping boxes
    of one class. "Close" is within twice the largest score change
    among the image's matched pairs (what rounding really moved), and never more than
    ``score_atol``.

    ``noisy``: the reference model's own detections under rounding-level noise (lists
    like ``reference``; ``engine.reference.reference_under_noise`` makes them). A
    reference detection that one of them lacks, or a candidate detection that one of
    them has and the reference lacks, is a choice rounding flips (a candidate at a
    top-k or threshold cut inside the model, say): unmatched, it is excused too, with
    what it suppresses.
    ``strict_f1`` excuses nothing.

    Every other field of a detection is compared on the matched pairs by its measure in
    ``verify.fields.MEASURES`` (masks by the pixels they flip at 0.5 and keypoints by
    how far they move, relative to their box; keypoint scores like scores). It is held
    to ``field_tolerances`` (by measure name) or the measure's default. A field with no
    measure is listed in ``unverified`` and named in the summary. The candidate must
    have the reference's keys.

    Labels are compared exactly: candidate labels that are not whole numbers fail.
    ``image_size`` (width, height) states the most a matched box's coordinate can move
    (``verify.boxes``; within the reference boxes' extent where not given).
    """
    _check_detections("reference", reference)
    if score_atol is None:
        score_atol, scores_from = detection_score_rule(_dtype_of_scores(reference, candidate))
    else:
        scores_from = f"scores within {score_atol:.2g}: given"
    boxes = [torch.as_tensor(item["boxes"]).reshape(-1, 4) for item in reference]
    rule = box_rule(torch.cat(boxes) if boxes else torch.zeros(0, 4), iou_threshold, image_size)
    result = DetectionComparison(
        passed=False,
        iou_threshold=iou_threshold,
        min_f1=min_f1,
        score_atol=score_atol,
        box_ceiling=max(rule.ceiling),
        source=f"matched by class and {rule.source}; {scores_from}",
    )
    try:
        _check_detections("candidate", candidate)
    except ValueError as error:
        result.reasons.append(str(error))
        result.precision = result.recall = result.f1 = result.strict_f1 = 0.0
        result.tolerance_ratio = math.inf
        return result
    if len(reference) != len(candidate):
        result.reasons.append(
            f"{len(candidate)} images of detections, the reference has {len(reference)}"
        )
    box_devs, score_devs, ious = [], [], []
    nonfinite = raw_references = raw_candidates = 0
    noisy_images = list(zip(*noisy, strict=True)) if noisy else [()] * len(reference)
    images = zip(reference, candidate, noisy_images, strict=False)  # lengths checked above
    for ref, cand, noisy_runs in images:
        if set(cand) != set(ref):
            _once(
                result.reasons,
                f"candidate keys {sorted(map(str, cand))} differ from the reference's "
                f"{sorted(map(str, ref))}",
            )
        for key in unmeasured(ref):
            _once(result.unverified, key)
        if not _whole_numbers(cand["labels"]):
            _once(result.reasons, "candidate labels are not whole numbers: they must be equal")
        ref_boxes, ref_scores, ref_labels = _as_arrays(ref)
        cand_boxes, cand_scores, cand_labels = _as_arrays(cand)
        result.images += 1
        result.reference_count += len(ref_scores)
        result.candidate_count += len(cand_scores)
        raw_references += len(ref_scores)
        raw_candidates += len(cand_scores)
        usable = np.isfinite(cand_boxes).all(axis=1) & np.isfinite(cand_scores)
        nonfinite += int((~usable).sum())
        iou = box_iou(ref_boxes, cand_boxes)
        eligible = (ref_labels[:, None] == cand_labels[None, :]) & usable[None, :]
        eligible &= iou >= iou_threshold
        image_start = len(score_devs)
        ref_matched = np.zeros(len(ref_scores), dtype=bool)
        cand_matched = np.zeros(len(cand_scores), dtype=bool)
        pairs = list(greedy_pairs(iou, eligible, np.argsort(-ref_scores, kind="stable")))
        for i, j in pairs:
            ref_matched[i] = cand_matched[j] = True
            result.matched += 1
            ious.append(iou[i, j])
            box_devs.append(np.abs(ref_boxes[i] - cand_boxes[j]).max())
            score_devs.append(abs(ref_scores[i] - cand_scores[j]))
        for name in measures_of(ref):
            if name not in result.fields:
                tolerance = (field_tolerances or {}).get(name)
                if tolerance is None:
                    tolerance = MEASURES[name].default(iou_threshold, score_atol)
                result.fields[name] = FieldDeviation(name, tolerance)
            if MEASURES[name].key in cand:
                problem = measure_pairs(result.fields[name], ref, cand, pairs, band=score_atol)
                if problem:
                    _once(result.reasons, f"candidate {problem}")
        cand_matched |= ~usable  # never excused
        # A near tie is a gap no wider than twice the largest score change among this
        # image's matched pairs: what the candidate's rounding actually moved, capped by
        # score_atol (the dtype's tolerance is far wider than what bf16 moves scores).
        # With no score moved at all nothing was rounded: no NMS choice can have flipped
        # on a tie, and a matched pair's twin elsewhere is a moved box (band 0: no ties).
        tie_band = min(score_atol, 2 * max(score_devs[image_start:], default=0.0))
        swapped, ref_excused, cand_excused = excuse(
            iou,
            (ref_boxes, ref_scores, ref_labels),
            (cand_boxes, cand_scores, cand_labels),
            ref_matched,
            cand_matched,
            [_as_arrays(run) for run in noisy_runs],
            tie_band=tie_band,
            tie_iou=tie_iou,
            iou_threshold=iou_threshold,
        )
        result.excused += 2 * swapped + ref_excused + cand_excused
        result.reference_count -= swapped + ref_excused
        result.candidate_count -= swapped + cand_excused
    if nonfinite:
        result.reasons.append(f"{nonfinite} candidate detections have NaN/inf boxes or scores")

    # No detections on either side is a perfect match; on one side only, none at all.
    result.strict_f1 = _f1(
        ratio(result.matched, raw_candidates), ratio(result.matched, raw_references)
    )
    result.precision = ratio(result.matched, result.candidate_count)
    result.recall = ratio(result.matched, result.reference_count)
    p, r = result.precision, result.recall
    result.f1 = _f1(p, r)
    if box_devs:
        result.max_box_deviation = float(max(box_devs))
        result.max_score_deviation = float(max(score_devs))
        result.mean_iou = float(np.mean(ious))

    f1_ratio = (
        (1 - result.f1) / (1 - min_f1) if min_f1 < 1 else (math.inf if result.f1 < 1 else 0.0)
    )
    score_ratio = (
        (result.max_score_deviation or 0.0) / score_atol
        if score_atol > 0
        else (math.inf if result.max_score_deviation else 0.0)
    )
    field_ratios = [each.tolerance_ratio for each in result.fields.values()]
    result.tolerance_ratio = max(f1_ratio, score_ratio, *field_ratios)
    if result.f1 < min_f1:
        result.reasons.append(f"F1 {result.f1:.4g} is below {min_f1:g}")
    if result.max_score_deviation is not None and result.max_score_deviation > score_atol:
        result.reasons.append(
            f"a matched score moved by {sci(result.max_score_deviation)}, "
            f"more than {sci(score_atol)}"
        )
    result.reasons += [
        f"matched {each.name} moved past tolerance"
        for each in result.fields.values()
        if not each.passed
    ]
    result.passed = not result.reasons
    return result


def _once(reasons: list[str], reason: str) -> None:
    """``reason`` added unless there already: said once, not once per image."""
    if reason not in reasons:
        reasons.append(reason)


def _f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def _check_detections(argument: str, detections) -> None:
    if not isinstance(detections, (list, tuple)):
        raise ValueError(
            f"{argument}: expected a list (one per image) of dicts with boxes [n, 4], "
            f"scores [n] and labels [n], got {type(detections).__name__}"
        )
    for index, item in enumerate(detections):
        where = f"{argument}[{index}]"
        if not isinstance(item, Mapping) or not set(MATCHED_KEYS) <= set(item):
            raise ValueError(f"{where}: expected a dict with keys boxes, scores and labels")
        n = len(item["scores"])
        if tuple(item["boxes"].shape) != (n, 4) or len(item["labels"]) != n:
            raise ValueError(
                f"{where}: expected boxes [n, 4], scores [n], labels [n]; got boxes "
                f"{list(item['boxes'].shape)}, scores [{n}], labels [{len(item['labels'])}]"
            )


def _dtype_of_scores(reference, candidate) -> torch.dtype:
    """The lower-precision scores dtype of the two, whose tolerance is the looser."""
    dtypes = [
        torch.as_tensor(item["scores"]).dtype
        for detections in (reference, candidate)
        if isinstance(detections, (list, tuple))
        for item in detections[:1]
        if isinstance(item, Mapping) and "scores" in item
    ]
    return max(dtypes, key=lambda dtype: default_tolerance(dtype)[0], default=torch.float32)


def _whole_numbers(labels) -> bool:
    labels = torch.as_tensor(labels)
    if not (labels.is_floating_point() or labels.is_complex()):
        return True
    return bool((labels == labels.real.round()).all())


def _as_arrays(detections):
    def array(value, dtype):
        return torch.as_tensor(value).detach().cpu().to(dtype).numpy()

    return (
        array(detections["boxes"], torch.float64).reshape(-1, 4),
        array(detections["scores"], torch.float64).reshape(-1),
        array(detections["labels"], torch.int64).reshape(-1),
    )
