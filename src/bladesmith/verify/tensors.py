"""Tensor outputs compared elementwise, with error statistics.

A tensor element passes when ``|candidate - reference| <= atol + rtol * |reference|``
(numpy's ``isclose``, relative to the reference). Like Polygraphy, a comparison reports
the error distribution (max, mean and 99th percentile of absolute and relative error),
not only pass or fail, and how far past its tolerance the worst element is, so that a
rejected pass says by how much it moved the outputs.

Integer and bool tensors must be equal, whatever tolerance is asked for. A ``ceiling``
caps what any element may move; a detector's boxes (``verify.boxes``) are capped at
what the IoU rule allows and each row must keep that IoU with its reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from bladesmith.bench import percentile
from bladesmith.verify._format import dtype_name, finite_or_none, sci
from bladesmith.verify.boxes import BoxRule, has_area, row_ious
from bladesmith.verify.tolerance import default_tolerance, exact_source, is_exact


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
    source: str = ""  # where the tolerance comes from
    ceiling: float | None = None  # the most any element may move, whatever rtol and atol
    # Boxes (``verify.boxes``): the IoU each row must keep, the lowest kept, the rows below
    iou_threshold: float | None = None
    min_iou: float | None = None
    below_iou: int = 0

    @property
    def exact(self) -> bool:
        return self.rtol == 0 and self.atol == 0

    def summary(self) -> str:
        if self.reasons:
            return "; ".join(self.reasons)
        if self.numel == 0:
            return "empty, shapes match"
        if self.exact:
            text = (
                f"{self.out_of_tolerance}/{self.numel} differ, max abs {sci(self.max_abs)} "
                "(must be equal)"
            )
        else:
            unit = " px" if self.iou_threshold is not None else ""
            at_most = f", at most {sci(self.ceiling)}{unit}" if self.ceiling is not None else ""
            text = (
                f"max abs {sci(self.max_abs)}{unit} (atol {sci(self.atol)}{at_most}), "
                f"p99 rel {sci(self.p99_rel)} (rtol {sci(self.rtol)}), "
                f"{self.out_of_tolerance}/{self.numel} out of tolerance"
            )
        if self.iou_threshold is not None and self.min_iou is not None:
            text += f", min IoU {self.min_iou:.3g} (>= {self.iou_threshold:g})"
            if self.below_iou:
                text += f", {self.below_iou} boxes below it"
        if self.nonfinite_mismatches:
            text += f", {self.nonfinite_mismatches} NaN/inf mismatches"
        if not self.passed and math.isfinite(self.tolerance_ratio):
            text += f", worst {sci(self.tolerance_ratio)}x its tolerance"
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
            "tolerance_ratio": finite_or_none(self.tolerance_ratio),
            "reasons": list(self.reasons),
            "source": self.source,
            "ceiling": self.ceiling,
            "iou_threshold": self.iou_threshold,
            "min_iou": self.min_iou,
            "below_iou": self.below_iou,
        }


def compare_tensors(
    reference,
    candidate,
    rtol=None,
    atol=None,
    *,
    ceiling: float | None = None,
    ceiling_source: str | None = None,
    source: str | None = None,
    boxes: BoxRule | None = None,
) -> TensorComparison:
    """Compare ``candidate`` with ``reference`` elementwise; tolerances default by dtype.

    When the dtypes differ within a kind (an fp16 candidate of an fp32 reference), the
    looser default of the two applies. Integer and bool tensors must be equal, whatever
    ``rtol`` and ``atol`` say. No element may move more than ``ceiling`` (whose
    ``ceiling_source`` is added to ``source`` where that does not say it); ``boxes``
    judges the tensor as boxes by that rule (its ceiling per coordinate, and each row's
    IoU with its reference row). ``source`` says where the tolerances come from. A
    different kind (float against integer), a different shape, or NaN/inf where the
    other output has something else, fails. Positions NaN in both, or the same
    infinity in both, agree.
    """
    reference = _as_tensor(reference).detach().cpu()
    candidate = _as_tensor(candidate).detach().cpu()
    if is_exact(reference.dtype) or is_exact(candidate.dtype):
        rtol, atol, ceiling, boxes = 0.0, 0.0, None, None
        source = exact_source(reference.dtype)
    else:
        ref_rtol, ref_atol = default_tolerance(reference.dtype)
        cand_rtol, cand_atol = default_tolerance(candidate.dtype)
        if source is None:
            looser = max(reference.dtype, candidate.dtype, key=default_tolerance)
            defaults = rtol is None and atol is None
            source = f"the default for {dtype_name(looser)} outputs" if defaults else "given"
        rtol = max(ref_rtol, cand_rtol) if rtol is None else float(rtol)
        atol = max(ref_atol, cand_atol) if atol is None else float(atol)
    if rtol < 0 or atol < 0:
        raise ValueError(f"tolerances must be >= 0, got rtol={rtol}, atol={atol}")
    result = TensorComparison(
        passed=False,
        shape=tuple(candidate.shape),
        dtype=dtype_name(candidate.dtype),
        reference_dtype=dtype_name(reference.dtype),
        rtol=rtol,
        atol=atol,
        source=source,
    )
    limit = None if ceiling is None else torch.tensor(float(ceiling), dtype=torch.float64)
    if limit is not None and ceiling_source:
        source = result.source = f"{source}, at most {ceiling_source} ({sci(ceiling)})"
    if boxes is not None:
        result.iou_threshold = boxes.iou_threshold
        per_coordinate = boxes.per_coordinate()
        limit = per_coordinate if limit is None else torch.minimum(limit, per_coordinate)
        result.source = f"{boxes.source}; within that, {source}"
    if limit is not None:
        result.ceiling = float(limit.max())
        result.atol = min(result.atol, result.ceiling)  # what is allowed, never past it
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
    _fill_statistics(result, reference, candidate, limit)
    if boxes is not None and result.numel:
        _judge_rows(result, reference, candidate, boxes.iou_threshold)
    result.passed = result.out_of_tolerance == 0 and result.below_iou == 0
    return result


def _judge_rows(result: TensorComparison, reference, candidate, iou_threshold: float) -> None:
    """Each box row with an area keeps IoU >= ``iou_threshold`` with its reference row
    (padding rows and points are judged by their coordinates alone)."""
    judged = has_area(reference)
    if not judged.any():
        return
    ious = row_ious(reference, candidate)[judged]
    result.min_iou = float(ious.min())
    result.below_iou = int((ious < iou_threshold).sum())
    if iou_threshold < 1:
        ratio = float((1 - ious.min()) / (1 - iou_threshold))
    else:
        ratio = math.inf if result.below_iou else 0.0
    result.tolerance_ratio = max(result.tolerance_ratio, ratio)


def _as_tensor(value) -> torch.Tensor:
    """``value`` as a tensor. A numpy array of one of numpy's platform aliases that torch
    does not take (``ulonglong``, what ONNX Runtime returns for uint64 on Linux, where
    ``uint64`` is ``ulong``), or in a non-native byte order, is first viewed or copied as
    the sized type of the same kind and width, so its values stay exact."""
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind in "biufc":
        array = np.asarray(value)
        sized = np.dtype(array.dtype.str).newbyteorder("=")
        if array.dtype.type is not sized.type or not array.dtype.isnative:
            array = array.view(sized) if array.dtype.isnative else array.astype(sized)
        return torch.as_tensor(array)
    return torch.as_tensor(value)


def _fill_statistics(result: TensorComparison, reference, candidate, limit=None) -> None:
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
    allowed = result.atol + result.rtol * ref_mag
    if limit is not None:
        allowed = torch.minimum(allowed, limit.expand(reference.shape).flatten()[finite])
    if result.exact:
        # Exact: compare in the native dtypes, as float64 cannot hold every int64.
        past = reference.flatten()[finite] != candidate.flatten()[finite]
    else:
        past = abs_err > allowed
    result.out_of_tolerance = int(past.sum()) + result.nonfinite_mismatches

    if abs_err.numel():
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


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"
