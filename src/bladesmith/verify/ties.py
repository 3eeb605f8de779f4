"""What rounding alone may change in a detector's output, and is excused for it.

Greedy NMS keeps one of two overlapping boxes of a class by score, and a list is cut at
a score: on a near tie either choice is right (``_tie_swaps``, ``_near_cut``). A
reference model run under rounding noise shows the choices rounding flips inside the
model (``_rounding_flips``). Either changes what a kept box suppresses, down a chain of
overlapping boxes (``_tie_consequences``). ``excuse`` applies all of them to one image.
"""

from __future__ import annotations

import numpy as np

from bladesmith.verify.matching import matches


def excuse(
    iou, ref, cand, ref_matched, cand_matched, noisy_runs, *, tie_band, tie_iou, iou_threshold
):
    """The unmatched detections of one image that a near tie or a rounding flip explains,
    marked matched (in place): (pairs swapped across the score cut or on an NMS tie,
    other reference detections excused, other candidate detections excused).
    ``ref``/``cand``: (boxes, scores, labels) arrays; ``noisy_runs``: the reference
    model's under rounding noise, the same way; ``tie_band``: how close two scores tie."""
    (ref_boxes, ref_scores, ref_labels), (cand_boxes, cand_scores, cand_labels) = ref, cand
    ties = _tie_swaps(
        iou,
        (ref_labels, ref_scores, ref_matched),
        (cand_labels, cand_scores, cand_matched),
        tie_iou,
        tie_band,
    )
    ref_flips, cand_flips = _rounding_flips(
        (ref_boxes, ref_labels, ref_matched),
        (cand_boxes, cand_labels, cand_matched),
        noisy_runs,
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
    # one (a duplicate, a detection lost at the threshold) is not excused. Its partner
    # may be a rounding flip at the cut: the room one list's flaky detection left (or
    # took) went to the next box there.
    ref_left = _near_cut(ref_scores, ~ref_matched, cand_scores, tie_band)
    cand_left = _near_cut(cand_scores, ~cand_matched, ref_scores, tie_band)
    across = min(ref_left, cand_left)
    ref_excused += min(ref_left - across, _near_cut(cand_scores, cand_flips, ref_scores, tie_band))
    cand_excused += min(cand_left - across, _near_cut(ref_scores, ref_flips, cand_scores, tie_band))
    return len(ties) + across, ref_excused, cand_excused


def _tie_swaps(iou, ref, cand, tie_iou: float, score_atol: float) -> list[tuple[int, int]]:
    """Pair unmatched detections that greedy NMS chose between on a near tie: same
    label, overlapping by at least ``tie_iou``, scores within ``score_atol``. ``ref`` and
    ``cand`` are (labels, scores, matched) of each list. Marks the pairs matched (in
    place) and returns them, (reference, candidate) indices."""
    (ref_labels, ref_scores, ref_matched), (cand_labels, cand_scores, cand_matched) = ref, cand
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
        kept, found = matches((ref_boxes, ref_labels), (boxes, labels), iou_threshold)
        ref_flips |= ~ref_matched & ~kept
        brought, _ = matches(
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
    seeds) explains. The box one list kept instead of its twin suppresses different
    neighbours, so an unmatched detection overlapping an excused one of the other list
    by at least ``tie_iou``, same label, went the other way because of the tie. And so
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


def _near_cut(scores, unmatched, other_scores, score_atol: float) -> int:
    """How many unmatched detections score within ``score_atol`` of the lowest score in
    the other list (its cut): they may lie on either side of it. One scoring further
    below is not excused: the other list should have had room for it."""
    if not len(other_scores) or score_atol <= 0:
        return 0
    return int((unmatched & (np.abs(scores - other_scores.min()) <= score_atol)).sum())
