"""Output comparison: tensors by tolerance and error statistics, detections by matching.

A tensor element passes when ``|candidate - reference| <= atol + rtol * |reference|``
(numpy's ``isclose``, relative to the reference). Like Polygraphy, a comparison reports
the error distribution (max, mean and 99th percentile of absolute and relative error),
not only pass or fail, and how far past its tolerance the worst element is, so that a
rejected pass says by how much it moved the outputs.

Detections (a list, one per image, of dicts with "boxes" [n, 4], "scores" [n] and
"labels" [n]) are compared without regard to order: two equally correct detectors may
emit the same boxes in another order, and NMS ties may resolve differently.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from bladesmith.bench import percentile

# Defaults by dtype, (rtol, atol). They are tuned for whole-model outputs after
# optimisation, not for single ops, so they are looser than torch.testing's:
# - float32: eps is 1.2e-7, but reordered reductions, fused kernels and another
#   convolution algorithm move a deep network's outputs by 1e-6..1e-5 relative; 1e-4
#   leaves room for that and still catches a wrong op (typically 1e-2 or more). TF32
#   matmuls (about 1e-3) fail on purpose: that precision change must be asked for.
# - float16: eps is 9.8e-4; rounding accumulates over the layers to a few eps, so
#   10 eps relative and 1 eps absolute. Polygraphy's users' first complaint is that its
#   1e-5 defaults fail every fp16 run.
# - bfloat16: eps is 7.8e-3 (8-bit mantissa); about 6 eps relative, 1e-2 absolute.
# - float64: torch.testing's, as nothing bladesmith does changes float64 arithmetic.
# - integers and bool (labels, counts, masks) must be equal.
_DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for outputs of ``dtype`` (see ``_DEFAULT_TOLERANCES`` for why).

    Complex dtypes use their real counterpart's. Other floating dtypes (float8) follow
    the float16 rule: ten eps relative, one eps absolute.
    """
    if dtype.is_complex:
        dtype = dtype.to_real()
    if dtype in _DEFAULT_TOLERANCES:
        return _DEFAULT_TOLERANCES[dtype]
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
        return (10 * eps, eps)
    return (0.0, 0.0)


@dataclass(frozen=True)
class Tolerance:
    """Override for one output; a field left None keeps the dtype's default."""

    rtol: float | None = None
    atol: float | None = None


@dataclass
class TensorComparison:
    """One tensor output against its reference. Errors are over elements finite in both."""

    passed: bool
    shape: tuple[int, ...]
    dtype: str
    reference_dtype: str
    rtol: float
    atol: float
    numel: int = 0
    out_of_tolerance: int = 0  # elements past tolerance, non-finite mismatches included
    nonfinite_mismatches: int = 0  # NaN or inf in one output where the other differs
    max_abs: float | None = None
    mean_abs: float | None = None
    p99_abs: float | None = None
    max_rel: float | None = None  # relative to |reference|, over non-zero references
    mean_rel: float | None = None
    p99_rel: float | None = None
    # Worst element's error over its allowance atol + rtol*|ref|: <= 1 passes; inf for an
    # exact (integer) mismatch or a non-finite mismatch.
    tolerance_ratio: float = 0.0
    reasons: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.reasons:
            return "; ".join(self.reasons)
        if self.numel == 0:
            return "empty, shapes match"
        if self.rtol == 0 and self.atol == 0:
            text = (
                f"{self.out_of_tolerance}/{self.numel} differ, max abs {_sci(self.max_abs)} "
                "(must be equal)"
            )
        else:
            text = (
                f"max abs {_sci(self.max_abs)} (atol {_sci(self.atol)}), "
                f"p99 rel {_sci(self.p99_rel)} (rtol {_sci(self.rtol)}), "
                f"{self.out_of_tolerance}/{self.numel} out of tolerance"
            )
        if self.nonfinite_mismatches:
            text += f", {self.nonfinite_mismatches} NaN/inf mismatches"
        if not self.passed and math.isfinite(self.tolerance_ratio):
            text += f", worst {_sci(self.tolerance_ratio)}x its tolerance"
        return text

    def to_dict(self) -> dict:
        return {
            "kind": "tensor",
            "passed": self.passed,
            "summary": self.summary(),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "reference_dtype": self.reference_dtype,
            "rtol": self.rtol,
            "atol": self.atol,
            "numel": self.numel,
            "out_of_tolerance": self.out_of_tolerance,
            "nonfinite_mismatches": self.nonfinite_mismatches,
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "p99_abs": self.p99_abs,
            "max_rel": self.max_rel,
            "mean_rel": self.mean_rel,
            "p99_rel": self.p99_rel,
            "tolerance_ratio": _finite_or_none(self.tolerance_ratio),
            "reasons": list(self.reasons),
        }


def compare_tensors(reference, candidate, rtol=None, atol=None) -> TensorComparison:
    """Compare ``candidate`` with ``reference`` elementwise; tolerances default by dtype.

    When the dtypes differ within a kind (an fp16 candidate of an fp32 reference), the
    looser default of the two applies. A different kind (float against integer), a
    different shape, or NaN/inf where the other output has something else, fails.
    Positions NaN in both, or the same infinity in both, agree.
    """
    reference = torch.as_tensor(reference).detach().cpu()
    candidate = torch.as_tensor(candidate).detach().cpu()
    ref_rtol, ref_atol = default_tolerance(reference.dtype)
    cand_rtol, cand_atol = default_tolerance(candidate.dtype)
    rtol = max(ref_rtol, cand_rtol) if rtol is None else float(rtol)
    atol = max(ref_atol, cand_atol) if atol is None else float(atol)
    if rtol < 0 or atol < 0:
        raise ValueError(f"tolerances must be >= 0, got rtol={rtol}, atol={atol}")
    result = TensorComparison(
        passed=False,
        shape=tuple(candidate.shape),
        dtype=_dtype_name(candidate.dtype),
        reference_dtype=_dtype_name(reference.dtype),
        rtol=rtol,
        atol=atol,
    )
    if _kind(reference.dtype) != _kind(candidate.dtype):
        result.reasons.append(
            f"dtype {result.dtype} is not comparable with the reference's {result.reference_dtype}"
        )
    if reference.shape != candidate.shape:
        result.reasons.append(
            f"shape {list(candidate.shape)} differs from the reference's {list(reference.shape)}"
        )
    if result.reasons:
        result.tolerance_ratio = math.inf
        return result
    _fill_statistics(result, reference, candidate)
    result.passed = result.out_of_tolerance == 0
    return result


def _fill_statistics(result: TensorComparison, reference, candidate) -> None:
    result.numel = reference.numel()
    if result.numel == 0:
        return
    wide = torch.complex128 if reference.is_complex() or candidate.is_complex() else torch.float64
    ref, cand = reference.to(wide).flatten(), candidate.to(wide).flatten()
    finite = torch.isfinite(ref) & torch.isfinite(cand)
    # Non-finite values agree when both are NaN or both the same infinity.
    agree = (torch.isnan(ref) & torch.isnan(cand)) | (ref == cand)
    result.nonfinite_mismatches = int((~finite & ~agree).sum())

    abs_err = (cand[finite] - ref[finite]).abs()
    ref_mag = ref[finite].abs()
    if result.rtol == 0 and result.atol == 0:
        # Exact: compare in the native dtypes, as float64 cannot hold every int64.
        past = reference.flatten()[finite] != candidate.flatten()[finite]
    else:
        past = abs_err > result.atol + result.rtol * ref_mag
    result.out_of_tolerance = int(past.sum()) + result.nonfinite_mismatches

    if abs_err.numel():
        allowed = result.atol + result.rtol * ref_mag
        ratio = torch.where(
            allowed > 0, abs_err / allowed.clamp_min(1e-300), torch.where(past, math.inf, 0.0)
        )
        result.tolerance_ratio = float(ratio.max())
        errors = abs_err.numpy()
        result.max_abs, result.mean_abs = float(errors.max()), float(errors.mean())
        result.p99_abs = percentile(errors, 99)
        nonzero = ref_mag > 0
        if nonzero.any():
            rel = (abs_err[nonzero] / ref_mag[nonzero]).numpy()
            result.max_rel, result.mean_rel = float(rel.max()), float(rel.mean())
            result.p99_rel = percentile(rel, 99)
    if result.nonfinite_mismatches:
        result.tolerance_ratio = math.inf


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
    tolerance_ratio: float = 0.0  # worst of the F1 shortfall and score deviation, as above
    reasons: list[str] = field(default_factory=list)

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
            + f"max box dev {_sci(self.max_box_deviation)} px, "
            f"max score dev {_sci(self.max_score_deviation)} (atol {_sci(self.score_atol)})"
        )
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
            "tolerance_ratio": _finite_or_none(self.tolerance_ratio),
            "reasons": list(self.reasons),
        }


_DETECTION_KEYS = ("boxes", "scores", "labels")
# Leaves compared as tensors (bool is an int; numpy scalars are np.generic).
_TENSOR_LIKE = (torch.Tensor, np.ndarray, np.generic, int, float, complex)


def is_detection_list(value) -> bool:
    """Whether ``value`` is a non-empty list of {"boxes", "scores", "labels"} dicts."""
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(item, Mapping) and set(_DETECTION_KEYS) <= set(item) for item in value)
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


# Rounding noise to probe a model with: each weight moved by about float16's (and TF32's)
# unit roundoff, 2^-11 of itself.
ROUNDING_NOISE = 2.0**-11


@torch.no_grad()
def reference_under_noise(
    model: torch.nn.Module, inputs: Sequence[tuple], runs: int = 2, relative: float = ROUNDING_NOISE
) -> list[list]:
    """The outputs of ``model`` on each of ``inputs`` (argument tuples) in ``runs`` runs,
    each with a copy whose floating-point parameters are multiplied by 1 + ``relative``
    times a standard normal draw (seeded: the same runs every call). What differs from
    the model's own outputs is what rounding alone can flip. ``model`` is untouched."""
    results = []
    for run in range(runs):
        noisy = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(run)
        for parameter in noisy.parameters():
            if parameter.is_floating_point():
                draw = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
                parameter.mul_((1 + relative * draw).to(parameter))
        results.append([noisy(*args) for args in inputs])
        del noisy
    return results


# Detection scores come out of a whole network, whose float32 convolutions run in TF32
# on recent NVIDIA GPUs (PyTorch's default for cuDNN), in the baseline too: another
# convolution algorithm (channels_last, a compiled kernel) moves them by ~1e-3.
_DETECTION_SCORE_ATOL_FLOOR = 5e-3


def detection_score_tolerance(dtype: torch.dtype) -> float:
    """How far a matched detection's score may move: rtol + atol of ``dtype`` (scores
    lie in [0, 1]), and never less than 5e-3."""
    rtol, atol = default_tolerance(dtype)
    return max(rtol + atol, _DETECTION_SCORE_ATOL_FLOOR)


def compare_detections(
    reference, candidate, iou_threshold=0.9, min_f1=0.99, score_atol=None, tie_iou=0.5, noisy=()
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
    score that close, either choice is right, and such an unmatched pair is excused too,
    with what follows from it: the box kept instead suppresses other neighbours, so an
    unmatched detection overlapping an excused one of the other list by ``tie_iou``
    (same class) is excused as well, and so on along such a chain of overlapping boxes
    of one class. "Close" is within twice the largest score change
    among the image's matched pairs (what rounding really moved), and never more than
    ``score_atol``.

    ``noisy``: the reference model's own detections under rounding-level noise (lists
    like ``reference``; ``reference_under_noise`` makes them). A reference detection
    that one of them lacks, or a candidate detection that one of them has and the
    reference lacks, is a choice rounding flips (a candidate at a top-k or threshold
    cut inside the model, say): unmatched, it is excused too, with what it suppresses.
    ``strict_f1`` excuses nothing.
    """
    _check_detections("reference", reference)
    if score_atol is None:
        score_atol = detection_score_tolerance(_dtype_of_scores(reference, candidate))
    result = DetectionComparison(
        passed=False, iou_threshold=iou_threshold, min_f1=min_f1, score_atol=score_atol
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
        ref_boxes, ref_scores, ref_labels = _as_arrays(ref)
        cand_boxes, cand_scores, cand_labels = _as_arrays(cand)
        result.images += 1
        result.reference_count += len(ref_scores)
        result.candidate_count += len(cand_scores)
        raw_references += len(ref_scores)
        raw_candidates += len(cand_scores)
        usable = np.isfinite(cand_boxes).all(axis=1) & np.isfinite(cand_scores)
        nonfinite += int((~usable).sum())
        iou = _box_iou(ref_boxes, cand_boxes)
        eligible = (ref_labels[:, None] == cand_labels[None, :]) & usable[None, :]
        eligible &= iou >= iou_threshold
        image_start = len(score_devs)
        ref_matched = np.zeros(len(ref_scores), dtype=bool)
        cand_matched = np.zeros(len(cand_scores), dtype=bool)
        for i, j in _greedy_pairs(iou, eligible, np.argsort(-ref_scores, kind="stable")):
            ref_matched[i] = cand_matched[j] = True
            result.matched += 1
            ious.append(iou[i, j])
            box_devs.append(np.abs(ref_boxes[i] - cand_boxes[j]).max())
            score_devs.append(abs(ref_scores[i] - cand_scores[j]))
        cand_matched |= ~usable  # never excused
        # A near tie is a gap no wider than twice the largest score change among this
        # image's matched pairs: what the candidate's rounding actually moved, capped by
        # score_atol (the dtype's tolerance is far wider than what bf16 moves scores).
        # With no score moved at all nothing was rounded: no NMS choice can have flipped
        # on a tie, and a matched pair's twin elsewhere is a moved box (band 0: no ties).
        tie_band = min(score_atol, 2 * max(score_devs[image_start:], default=0.0))
        ties = _tie_swaps(
            iou,
            ref_labels,
            cand_labels,
            ref_scores,
            cand_scores,
            ref_matched,
            cand_matched,
            tie_iou,
            tie_band,
        )
        ref_flips, cand_flips = _rounding_flips(
            (ref_boxes, ref_labels, ref_matched),
            (cand_boxes, cand_labels, cand_matched),
            [_as_arrays(run) for run in noisy_runs],
            iou_threshold,
        )
        ref_seeds, cand_seeds = ref_flips.copy(), cand_flips.copy()
        for i, j in ties:
            ref_seeds[i] = cand_seeds[j] = True
        ref_excused, cand_excused = _tie_consequences(
            iou, ref_labels, cand_labels, ref_matched, cand_matched, ref_seeds, cand_seeds, tie_iou
        )
        ref_excused += int(ref_flips.sum())
        cand_excused += int(cand_flips.sum())
        # Swaps across the cut come in pairs: one left each list near the cut. A lone
        # one (a duplicate, a detection lost at the threshold) is not excused.
        swapped = len(ties) + min(
            _near_cut(ref_scores, ~ref_matched, cand_scores, tie_band),
            _near_cut(cand_scores, ~cand_matched, ref_scores, tie_band),
        )
        result.excused += 2 * swapped + ref_excused + cand_excused
        result.reference_count -= swapped + ref_excused
        result.candidate_count -= swapped + cand_excused
    if nonfinite:
        result.reasons.append(f"{nonfinite} candidate detections have NaN/inf boxes or scores")

    # No detections on either side is a perfect match; on one side only, none at all.
    result.strict_f1 = _f1(
        _ratio(result.matched, raw_candidates), _ratio(result.matched, raw_references)
    )
    result.precision = _ratio(result.matched, result.candidate_count)
    result.recall = _ratio(result.matched, result.reference_count)
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
    result.tolerance_ratio = max(f1_ratio, score_ratio)
    if result.f1 < min_f1:
        result.reasons.append(f"F1 {result.f1:.4g} is below {min_f1:g}")
    if result.max_score_deviation is not None and result.max_score_deviation > score_atol:
        result.reasons.append(
            f"a matched score moved by {_sci(result.max_score_deviation)}, "
            f"more than {_sci(score_atol)}"
        )
    result.passed = not result.reasons
    return result


def _tie_swaps(
    iou,
    ref_labels,
    cand_labels,
    ref_scores,
    cand_scores,
    ref_matched,
    cand_matched,
    tie_iou: float,
    score_atol: float,
) -> list[tuple[int, int]]:
    """Pair unmatched detections that greedy NMS chose between on a near tie: same
    label, overlapping by at least ``tie_iou``, scores within ``score_atol``. Marks the
    pairs matched (in place) and returns them, (reference, candidate) indices."""
    pairs = []
    if score_atol <= 0:
        return pairs
    for i in np.argsort(-ref_scores, kind="stable"):
        if ref_matched[i]:
            continue
        candidates = (
            ~cand_matched
            & (cand_labels == ref_labels[i])
            & (iou[i] >= tie_iou)
            & (np.abs(cand_scores - ref_scores[i]) <= score_atol)
        )
        if candidates.any():
            j = int(np.where(candidates, iou[i], -1.0).argmax())
            ref_matched[i] = cand_matched[j] = True
            pairs.append((i, j))
    return pairs


def _greedy_pairs(iou, eligible, order):
    """One-to-one pairs (i, j): each row i, in ``order``, takes the eligible column of
    highest IoU that no earlier row took. Consumes ``eligible``."""
    for i in order:
        row = np.where(eligible[i], iou[i], -1.0)
        j = int(row.argmax()) if row.size else -1
        if j >= 0 and row[j] >= 0:
            eligible[:, j] = False
            yield i, j


def _matches(first, second, iou_threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Which detections of ``first`` and of ``second`` (each (boxes, labels)) match one
    another: same label, IoU at least ``iou_threshold``, one to one, greedily by overlap."""
    (boxes, labels), (other_boxes, other_labels) = first, second
    matched = np.zeros(len(boxes), dtype=bool)
    other_matched = np.zeros(len(other_boxes), dtype=bool)
    iou = _box_iou(boxes, other_boxes)
    eligible = (labels[:, None] == other_labels[None, :]) & (iou >= iou_threshold)
    for i, j in _greedy_pairs(iou, eligible, range(len(boxes))):
        matched[i] = other_matched[j] = True
    return matched, other_matched


def _rounding_flips(ref, cand, noisy_runs, iou_threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Unmatched detections that the reference model itself flips under rounding noise
    (``noisy_runs``: its (boxes, scores, labels) of this image in each noisy run): one
    of the reference's that a run lacks, one of the candidate's that a run has and the
    reference lacks. ``ref`` and ``cand`` are (boxes, labels, matched) of each list.
    Marks them matched (in place) and returns their masks."""
    (ref_boxes, ref_labels, ref_matched), (cand_boxes, cand_labels, cand_matched) = ref, cand
    ref_flips = np.zeros_like(ref_matched)
    cand_flips = np.zeros_like(cand_matched)
    for boxes, _, labels in noisy_runs:
        kept, found = _matches((ref_boxes, ref_labels), (boxes, labels), iou_threshold)
        ref_flips |= ~ref_matched & ~kept
        brought, _ = _matches(
            (cand_boxes, cand_labels), (boxes[~found], labels[~found]), iou_threshold
        )
        cand_flips |= ~cand_matched & brought
    ref_matched |= ref_flips
    cand_matched |= cand_flips
    return ref_flips, cand_flips


def _tie_consequences(
    iou, ref_labels, cand_labels, ref_matched, cand_matched, ref_seeds, cand_seeds, tie_iou: float
) -> tuple[int, int]:
    """Unmatched detections that a near tie's other choice (or a rounding flip: the
    seeds) explains: the box one list kept instead of its twin suppresses different
    neighbours, so an unmatched detection overlapping an excused one of the other list
    by at least ``tie_iou``, same label, went the other way because of the tie; and so
    on along the chain, as a neighbour kept in one list suppresses its own neighbours
    there. Marks them matched (in place) and returns how many there are in the
    reference and in the candidate."""
    linked = (iou >= tie_iou) & (ref_labels[:, None] == cand_labels[None, :])
    ref_excused = np.zeros_like(ref_matched)
    cand_excused = np.zeros_like(cand_matched)
    ref_front, cand_front = ref_seeds, cand_seeds
    while ref_front.any() or cand_front.any():
        new_cand = ~cand_matched & ~cand_excused & linked[ref_front].any(axis=0)
        new_ref = ~ref_matched & ~ref_excused & linked[:, cand_front].any(axis=1)
        cand_excused |= new_cand
        ref_excused |= new_ref
        ref_front, cand_front = new_ref, new_cand
    cand_matched |= cand_excused
    ref_matched |= ref_excused
    return int(ref_excused.sum()), int(cand_excused.sum())


def _f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def _near_cut(scores, unmatched, other_scores, score_atol: float) -> int:
    """How many unmatched detections score within ``score_atol`` of the lowest score in
    the other list (its cut): they may lie on either side of it. One scoring further
    below is not excused: the other list should have had room for it."""
    if not len(other_scores) or score_atol <= 0:
        return 0
    return int((unmatched & (np.abs(scores - other_scores.min()) <= score_atol)).sum())


def _check_detections(argument: str, detections) -> None:
    if not isinstance(detections, (list, tuple)):
        raise ValueError(
            f"{argument}: expected a list (one per image) of dicts with boxes [n, 4], "
            f"scores [n] and labels [n], got {type(detections).__name__}"
        )
    for index, item in enumerate(detections):
        where = f"{argument}[{index}]"
        if not isinstance(item, Mapping) or not set(_DETECTION_KEYS) <= set(item):
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


def _as_arrays(detections):
    def array(value, dtype):
        return torch.as_tensor(value).detach().cpu().to(dtype).numpy()

    return (
        array(detections["boxes"], torch.float64).reshape(-1, 4),
        array(detections["scores"], torch.float64).reshape(-1),
        array(detections["labels"], torch.int64).reshape(-1),
    )


def _box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of [n, 4] and [m, 4] (x1, y1, x2, y2) boxes; two identical empty boxes: 1."""
    area_a = (a[:, 2] - a[:, 0]).clip(0) * (a[:, 3] - a[:, 1]).clip(0)
    area_b = (b[:, 2] - b[:, 0]).clip(0) * (b[:, 3] - b[:, 1]).clip(0)
    low = np.maximum(a[:, None, :2], b[None, :, :2])
    high = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (high - low).clip(0).prod(axis=2)
    union = area_a[:, None] + area_b[None, :] - inter
    identical = (a[:, None, :] == b[None, :, :]).all(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, inter / union, identical.astype(np.float64))
    return np.nan_to_num(iou, nan=0.0)


@dataclass
class Comparison:
    """Every output of a model against the reference's, by path ("out[0]['boxes']")."""

    outputs: dict[str, TensorComparison | DetectionComparison] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # structure mismatches, by path

    @property
    def passed(self) -> bool:
        return not self.reasons and all(output.passed for output in self.outputs.values())

    @property
    def tolerance_ratio(self) -> float:
        """The worst output's error over its tolerance: > 1 is past it."""
        ratios = [output.tolerance_ratio for output in self.outputs.values()]
        return math.inf if self.reasons else max(ratios, default=0.0)

    def failures(self) -> list[str]:
        return [*self.reasons] + [
            f"{path}: {output.summary()}"
            for path, output in self.outputs.items()
            if not output.passed
        ]

    def summary(self) -> str:
        failures = self.failures()
        if failures:
            shown = "; ".join(failures[:3])
            return shown + (f"; and {len(failures) - 3} more" if len(failures) > 3 else "")
        if len(self.outputs) == 1:
            return next(iter(self.outputs.values())).summary()
        if not self.outputs:
            return "no outputs to compare"
        path, closest = max(self.outputs.items(), key=lambda item: item[1].tolerance_ratio)
        return (
            f"all {len(self.outputs)} outputs within tolerance; closest to its limit "
            f"{path}: {closest.summary()}"
        )

    def to_dict(self) -> dict:
        return {
            "kind": "outputs",
            "passed": self.passed,
            "summary": self.summary(),
            "tolerance_ratio": _finite_or_none(self.tolerance_ratio),
            "reasons": list(self.reasons),
            "outputs": {path: output.to_dict() for path, output in self.outputs.items()},
        }


def compare_outputs(
    reference,
    candidate,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: Mapping[str | int, Tolerance] | None = None,
    iou_threshold: float = 0.9,
    min_f1: float = 0.99,
    score_atol: float | None = None,
    noisy: Sequence = (),
    name: str = "out",
) -> Comparison:
    """Compare a model's outputs with the reference's, whatever their structure.

    Tensors (and numbers, numpy arrays) are compared with ``compare_tensors``; tuples,
    lists and dicts recursively; a list of {"boxes", "scores", "labels"} dicts with
    ``compare_detections``. ``rtol``/``atol`` override the dtype defaults for every
    tensor; ``tolerances`` overrides them per output, keyed by its full path
    ("out[1]", "out['logits']") or its last index or key (1, "logits"); the full path
    wins. A key that names no output is an error, so a typo cannot go unnoticed.
    ``noisy``: the reference model's outputs under rounding noise, structured like
    ``reference`` (``reference_under_noise``), for ``compare_detections``.
    """
    tolerances = dict(tolerances or {})
    result = Comparison()
    used: set = set()

    def visit(path: str, last, ref, cand, noisy: list) -> None:
        if is_detection_list(ref):
            result.outputs[path] = compare_detections(
                ref,
                cand,
                iou_threshold=iou_threshold,
                min_f1=min_f1,
                score_atol=score_atol,
                noisy=noisy,
            )
        elif isinstance(ref, Mapping):
            if not isinstance(cand, Mapping):
                result.reasons.append(f"{path}: expected a dict, got {type(cand).__name__}")
            elif set(ref) != set(cand):
                result.reasons.append(
                    f"{path}: keys {sorted(map(str, cand))} differ from the reference's "
                    f"{sorted(map(str, ref))}"
                )
            else:
                for key in ref:
                    visit(f"{path}[{key!r}]", key, ref[key], cand[key], [n[key] for n in noisy])
        elif isinstance(ref, (list, tuple)):
            if not isinstance(cand, (list, tuple)):
                result.reasons.append(f"{path}: expected a sequence, got {type(cand).__name__}")
            elif len(ref) != len(cand):
                result.reasons.append(f"{path}: {len(cand)} items, the reference has {len(ref)}")
            else:
                for index, (r, c) in enumerate(zip(ref, cand, strict=True)):
                    visit(f"{path}[{index}]", index, r, c, [n[index] for n in noisy])
        elif isinstance(ref, _TENSOR_LIKE):
            if not isinstance(cand, _TENSOR_LIKE):
                result.reasons.append(f"{path}: expected a tensor, got {type(cand).__name__}")
                return
            keys = [key for key in (path, last) if key in tolerances]
            override = tolerances[keys[0]] if keys else Tolerance()
            used.update(keys)
            result.outputs[path] = compare_tensors(
                ref,
                cand,
                rtol=override.rtol if override.rtol is not None else rtol,
                atol=override.atol if override.atol is not None else atol,
            )
        elif ref is None or isinstance(ref, str):
            if ref != cand:
                result.reasons.append(f"{path}: {cand!r} differs from the reference's {ref!r}")
        else:
            raise TypeError(
                f"reference {path}: cannot compare outputs of type {type(ref).__name__}; "
                "expected tensors, numbers, strings, None, or tuples, lists and dicts of them"
            )

    visit(name, None, reference, candidate, list(noisy))
    unused = set(tolerances) - used
    if unused:
        raise ValueError(
            f"tolerances: no output is named {sorted(map(str, unused))}; "
            f"outputs are {list(result.outputs)}"
        )
    return result


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ratio(numerator: int, denominator: int) -> float:
    if denominator == 0:
        return 1.0 if numerator == 0 else 0.0
    return numerator / denominator


def _finite_or_none(value: float) -> float | None:
    """JSON has no inf: an infinite ratio is written as null."""
    return value if math.isfinite(value) else None


def _sci(value: float | None) -> str:
    """Compact numbers for summaries: 3.1e-3, 1e-5, 0.8, 12.5, 2e5, 0, n/a."""
    if value is None:
        return "n/a"
    if value == 0 or 1e-2 <= abs(value) < 1e3:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
