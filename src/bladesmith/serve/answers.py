"""Served answers compared with reference answers: whether an answer is its row's, within
the rounding of the dtype the model computes in (the load test's judgement, and the
runner's check of its smaller buckets), and how far it is from another row's.

An answer is a dict of the served outputs by name, rows first. A detector's (the padded
boxes, scores, labels and num_detections, then any field of each detection: a Mask R-CNN's
masks) is compared as ``optimize``'s gate compares detections, after its padding is cut as
``bladesmith.client`` cuts it: every field on the matched detections, by its measure in
``verify.fields`` (masks by the pixels that cross 0.5 beyond the rounding of the dtype).
"""

from __future__ import annotations

import numpy as np
import torch

from bladesmith.families.base import DetectionFamily
from bladesmith.verify import compare_detections
from bladesmith.verify.tolerance import default_tolerance, detection_score_tolerance


def comparison(compute_dtype: str | None):
    """``same(answer, reference, variants=())``: whether a served answer equals the
    reference within the rounding of ``compute_dtype`` (the dtype the model computes
    in, e.g. "float16"; None: the outputs' own); a detector's ``variants`` (the same
    rows' answers from other slots) excuse the detections that the slot alone flips."""
    compute = getattr(torch, compute_dtype or "", None)
    compute = compute if isinstance(compute, torch.dtype) else None

    def same(answer: dict, reference: dict, variants=()) -> bool:
        if not _same_form(answer, reference):
            return False
        if is_detector(reference):
            score_atol = detection_score_tolerance(compute) if compute else None
            compared = compare_detections(
                _detections(reference),
                _detections(answer),
                score_atol=score_atol,
                noisy=[_detections(variant) for variant in variants],
            )
            # A field that no measure compares is not known to be right.
            return compared.passed and not compared.unverified
        return all(_close(answer[name], expected, compute) for name, expected in reference.items())

    return same


def distance(answer: dict, reference: dict) -> float:
    """How far a served answer is from a reference: a detector's 1 - F1 of their
    detections (matched as the gate matches them; their fields, such as masks, aside),
    another model's largest absolute difference; infinite where the outputs' names or
    shapes differ."""
    if not _same_form(answer, reference):
        return float("inf")
    if is_detector(reference):
        return 1.0 - compare_detections(_detections(reference), _detections(answer)).f1
    return max(
        float(np.abs(answer[name].astype(np.float64) - expected).max(initial=0.0))
        for name, expected in reference.items()
    )


def is_detector(names) -> bool:
    """Whether outputs named ``names`` (in order) are a detector's padded ones: boxes,
    scores, labels and num_detections, then any field of each detection (masks)."""
    return tuple(names)[:4] == DetectionFamily.output_names


def cut_padding(row: dict) -> dict:
    """One image's padded detections cut to its count: torchvision's dict (boxes, scores,
    labels and each field of a detection, such as masks)."""
    count = int(row["num_detections"].reshape(-1)[0])
    return {name: value[:count] for name, value in row.items() if name != "num_detections"}


def _same_form(answer: dict, reference: dict) -> bool:
    return answer.keys() == reference.keys() and all(
        answer[name].shape == expected.shape for name, expected in reference.items()
    )


def _close(got: np.ndarray, expected: np.ndarray, compute) -> bool:
    if not np.issubdtype(expected.dtype, np.floating):
        return np.array_equal(got, expected)
    # The coarser of the output's dtype and the one the model computes in.
    dtypes = [torch.from_numpy(np.zeros(0, expected.dtype)).dtype, *([compute] if compute else [])]
    rtol, atol = max(default_tolerance(dtype) for dtype in dtypes)
    # NaN where the row's own answer has NaN is that answer (a row whose mask hides all).
    return np.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)


def _detections(answer: dict) -> list[dict]:
    """A served answer's padded detections, one dict of tensors per row, padding cut."""
    rows = len(answer["num_detections"])
    per_row = [
        cut_padding({name: value[row] for name, value in answer.items()}) for row in range(rows)
    ]
    # np.array: a writable copy (tritonclient's arrays are read-only).
    return [
        {name: torch.from_numpy(np.array(value)) for name, value in row.items()} for row in per_row
    ]
