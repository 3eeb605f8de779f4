"""Served answers compared with reference answers: whether an answer is its row's, within
the rounding of the dtype the model computes in (the load test's judgement, and the
runner's check of its smaller buckets), and how far it is from another row's.

An answer is a dict of the served outputs by name, rows first. A detector's (the padded
boxes, scores, labels and num_detections, then any field of each detection: a Mask R-CNN's
masks) is compared as ``optimize``'s gate compares detections, after its padding is cut as
``bladesmith.client`` cuts it: every field on the matched detections, by its measure in
``verify.fields`` (masks by the pixels that cross 0.5 beyond the rounding of the dtype).
``compact`` keeps a detector's answer in what that judgement reads, a fraction of its
memory (a Mask R-CNN's padded answer at 480x640 is 123 MB), for the same verdicts.
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
    compute = _compute(compute_dtype)

    def same(answer, reference, variants=()) -> bool:
        if not _same_form(answer, reference):
            return False
        if is_detector(_shapes(reference)):
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


def distance(answer, reference) -> float:
    """How far a served answer is from a reference: a detector's 1 - F1 of their
    detections (matched as the gate matches them; their fields, such as masks, aside),
    another model's largest absolute difference; infinite where the outputs' names or
    shapes differ."""
    if not _same_form(answer, reference):
        return float("inf")
    if is_detector(_shapes(reference)):
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


def compact(answer: dict, compute_dtype: str | None):
    """``answer`` as the load test keeps it until it judges it: a detector's as
    ``Detections`` (its padding cut, its masks packed), which ``comparison`` and
    ``distance`` judge as they judge the answer itself; any other as it is."""
    if not is_detector(answer):
        return answer
    # The band the mask measure is given: the score tolerance of the dtype the model
    # computes in, else of the scores' (the reference's and the answer's: one served dtype).
    compute = _compute(compute_dtype) or _torch_dtype(answer["scores"].dtype)
    return Detections(answer, detection_score_tolerance(compute))


class Detections:
    """A detector's served answer in the memory its judgement needs: each output's served
    shape (padding included, as ``_same_form`` compares them) and each row's detections
    with the padding cut (copies: no view keeps the padded arrays alive), the masks packed
    (``PackedMasks``)."""

    def __init__(self, answer: dict, band: float):
        self.shapes = {name: value.shape for name, value in answer.items()}
        self._rows = [
            {
                name: PackedMasks(value, band) if name == "masks" else value.copy()
                for name, value in row.items()
            }
            for row in _cut_rows(answer)
        ]

    @property
    def nbytes(self) -> int:
        return sum(value.nbytes for row in self._rows for value in row.values())

    def rows(self) -> list[dict]:
        """Each row's detections, padding cut, masks unpacked."""
        return [
            {
                name: value.unpacked() if isinstance(value, PackedMasks) else value
                for name, value in row.items()
            }
            for row in self._rows
        ]


class PackedMasks:
    """One image's masks [n, ...] in what the mask measure (``verify.fields``) reads of
    them: each pixel's side of 0.5 (a bit), and the values of the pixels within ``band``
    (the measure's) of 0.5, and of those not finite (they fail their mask). The measure
    sees a pixel farther from 0.5 only by its side: a pixel of the other answer within
    ``band`` of it is on that side too. So such a pixel comes back as 0 or 1, as far from
    0.5 (``band`` is below 0.5), and every deviation is the same: about a bit a pixel in
    place of a float's 32."""

    def __init__(self, masks: np.ndarray, band: float):
        self.shape, self.dtype = masks.shape, masks.dtype
        pixels = masks.reshape(len(masks), -1)
        self.above = np.empty((len(pixels), (pixels.shape[1] + 7) // 8), np.uint8)
        exact = [np.zeros(0, np.int64)]
        for k, mask in enumerate(pixels):  # one at a time: float64 temporaries of one mask
            self.above[k] = np.packbits(mask > 0.5)
            off = np.abs(mask.astype(np.float64) - 0.5)  # in float64, as the measure computes
            exact.append(np.flatnonzero(~((off > band) & (off < np.inf))) + k * mask.size)
        self.exact = np.concatenate(exact)
        self.values = pixels.reshape(-1)[self.exact]

    @property
    def nbytes(self) -> int:
        return self.above.nbytes + self.exact.nbytes + self.values.nbytes

    def unpacked(self) -> np.ndarray:
        size = int(np.prod(self.shape[1:], dtype=np.int64))
        pixels = np.unpackbits(self.above, axis=1, count=size).astype(self.dtype)
        pixels.reshape(-1)[self.exact] = self.values
        return pixels.reshape(self.shape)


def _compute(compute_dtype: str | None) -> torch.dtype | None:
    compute = getattr(torch, compute_dtype or "", None)
    return compute if isinstance(compute, torch.dtype) else None


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def _same_form(answer, reference) -> bool:
    answer, reference = _shapes(answer), _shapes(reference)
    return answer.keys() == reference.keys() and all(
        answer[name] == shape for name, shape in reference.items()
    )


def _shapes(answer) -> dict:
    if isinstance(answer, Detections):
        return answer.shapes
    return {name: value.shape for name, value in answer.items()}


def _close(got: np.ndarray, expected: np.ndarray, compute) -> bool:
    if not np.issubdtype(expected.dtype, np.floating):
        return np.array_equal(got, expected)
    # The coarser of the output's dtype and the one the model computes in.
    dtypes = [_torch_dtype(expected.dtype), *([compute] if compute else [])]
    rtol, atol = max(default_tolerance(dtype) for dtype in dtypes)
    # NaN where the row's own answer has NaN is that answer (a row whose mask hides all).
    return np.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)


def _detections(answer) -> list[dict]:
    """A served answer's detections (or ``Detections``'), one dict of tensors per row,
    padding cut."""
    rows = answer.rows() if isinstance(answer, Detections) else _cut_rows(answer)
    # np.array: a writable copy (tritonclient's arrays are read-only).
    return [
        {name: torch.from_numpy(np.array(value)) for name, value in row.items()} for row in rows
    ]


def _cut_rows(answer: dict) -> list[dict]:
    """A served answer's padded detections, one dict of arrays per row, padding cut."""
    rows = len(answer["num_detections"])
    return [
        cut_padding({name: value[row] for name, value in answer.items()}) for row in range(rows)
    ]
