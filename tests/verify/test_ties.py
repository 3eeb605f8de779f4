"""verify.ties: what rounding alone may change in detections is excused, nothing else."""

from __future__ import annotations

import pytest
import torch
from verify_testing import one_image

from bladesmith.verify import (
    compare_detections,
)


def _ranked(scores, labels=None):
    """Detections of one image, boxes far apart so that only equal indices match."""
    scores = torch.tensor(scores)
    n = len(scores)
    offsets = torch.arange(n, dtype=torch.float32)[:, None] * 100
    boxes = offsets + torch.tensor([0.0, 0.0, 50.0, 50.0])
    labels = torch.zeros(n, dtype=torch.int64) if labels is None else torch.tensor(labels)
    return {"boxes": boxes, "scores": scores, "labels": labels}


def test_detections_at_the_score_cut_are_excused():
    # Both lists keep 3 per image; rounding swapped which of two near-equal detections
    # made the cut (0.5001 vs 0.4999): neither side is wrong.
    reference = _ranked([0.9, 0.7, 0.5001, 0.0])
    candidate = _ranked([0.9, 0.7003, 0.0, 0.4999])  # rounding moved a score by 3e-4
    reference = [{k: v[:3] for k, v in reference.items()}]
    candidate = [{k: v[[0, 1, 3]] for k, v in candidate.items()}]
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert result.passed, result.summary()
    assert result.excused == 2 and result.matched == 2 and result.f1 == 1.0
    assert result.strict_f1 == 2 / 3  # 2 matched of 3 on each side
    assert "2 on near ties or rounding flips excused; strict F1 0.6667" in result.summary()
    assert result.to_dict()["strict_f1"] == result.strict_f1


def test_detections_far_below_the_cut_are_not_excused():
    # A candidate that lost every detection but the first must not pass.
    reference = [_ranked([0.9, 0.6, 0.4, 0.2])]
    candidate = [{k: v[:1] for k, v in _ranked([0.9, 0.6, 0.4, 0.2]).items()}]
    result = compare_detections(reference, candidate, score_atol=5e-3)
    assert not result.passed and result.excused == 0 and result.recall == 0.25


@pytest.mark.parametrize(
    ("shifted_box", "shifted_score", "excused"),
    [
        ([10.0, 0.0, 110.0, 100.0], 0.7995, True),  # IoU 0.82 with the kept box, near tie
        ([10.0, 0.0, 110.0, 100.0], 0.75, False),  # same overlap, scores far apart
        ([60.0, 0.0, 160.0, 100.0], 0.7995, False),  # a near tie, but IoU 0.25
    ],
)
def test_nms_choice_on_a_near_tie_is_excused(shifted_box, shifted_score, excused):
    # NMS kept the reference's box; the candidate's rounding kept its overlapping twin.
    low = [300.0, 300.0, 400.0, 400.0]
    reference = [one_image([[0.0, 0.0, 100.0, 100.0], low], [0.8, 0.1])]
    candidate = [one_image([shifted_box, low], [shifted_score, 0.1004])]  # rounding: 4e-4
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert result.passed is excused, result.summary()
    assert result.excused == (2 if excused else 0)


def test_near_ties_are_judged_by_what_rounding_really_moved():
    # Same swap as above, but the matched scores are bit-identical: nothing was
    # rounded differently, so a 5e-4 gap is no tie, whatever score_atol allows.
    low = [300.0, 300.0, 400.0, 400.0]
    reference = [one_image([[0.0, 0.0, 100.0, 100.0], low], [0.8, 0.1])]
    candidate = [one_image([[10.0, 0.0, 110.0, 100.0], low], [0.7995, 0.1])]
    result = compare_detections(reference, candidate, score_atol=1e-2)
    assert not result.passed and result.excused == 0


@pytest.mark.parametrize(
    ("neighbour", "excused"),
    [
        ([-30.0, 0.0, 70.0, 100.0], True),  # IoU 0.54 with the reference's choice
        ([500.0, 0.0, 600.0, 100.0], False),  # overlaps neither twin: a real extra
    ],
)
def test_what_a_near_tie_suppresses_is_excused_with_it(neighbour, excused):
    # The reference kept A, which suppressed the neighbour; the candidate kept A's twin
    # B (a near tie), which overlaps the neighbour too little to suppress it.
    a, b = [0.0, 0.0, 100.0, 100.0], [30.0, 0.0, 130.0, 100.0]  # IoU 0.54
    low = [300.0, 300.0, 400.0, 400.0]
    reference = [one_image([a, low], [0.8, 0.1])]
    candidate = [one_image([b, neighbour, low], [0.8002, 0.5, 0.1003])]  # rounding: 3e-4
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert result.passed is excused, result.summary()
    assert result.excused == (3 if excused else 2)
    assert result.strict_f1 == pytest.approx(0.4)  # 1 matched of 2 and of 3


def test_a_near_tie_excuses_the_chain_of_suppressions_it_changes():
    # The reference kept A, which suppressed N1, so N2 (overlapping N1, not A) stayed.
    # The candidate kept A's twin B, which leaves N1, and N1 suppresses N2.
    a, b = [0.0, 0.0, 100.0, 100.0], [30.0, 0.0, 130.0, 100.0]  # IoU 0.54
    n1, n2 = [-30.0, 0.0, 70.0, 100.0], [-60.0, 0.0, 40.0, 100.0]  # A-N1, N1-N2: 0.54
    low = [300.0, 300.0, 400.0, 400.0]
    reference = [one_image([a, n2, low], [0.8, 0.45, 0.1])]
    candidate = [one_image([b, n1, low], [0.8002, 0.5, 0.1003])]  # rounding: 3e-4
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert result.passed, result.summary()
    assert result.excused == 4
    # Without the tie that starts it, the same chain is no excuse.
    untied = [one_image([[500.0, 0.0, 600.0, 100.0], n1, low], [0.8002, 0.5, 0.1003])]
    assert compare_detections(reference, untied, score_atol=1e-3).excused == 0


def test_detections_the_reference_flips_under_rounding_noise_are_excused():
    # The reference keeps A; under rounding noise the model itself kept B instead (a
    # candidate at a cut inside the model): a candidate that keeps B is not at fault.
    a, b = [0.0, 0.0, 100.0, 100.0], [300.0, 0.0, 400.0, 100.0]
    stable = [[0.0, 300.0, 100.0, 400.0], [200.0, 300.0, 300.0, 400.0]]
    reference = [one_image([a, *stable], [0.9, 0.6, 0.5])]
    noisy = [[one_image([b, *stable], [0.9, 0.6, 0.5])]]
    candidate = [one_image([b, *stable], [0.9, 0.6, 0.5])]
    assert not compare_detections(reference, candidate).passed
    result = compare_detections(reference, candidate, noisy=noisy)
    assert result.passed and result.excused == 2, result.summary()
    assert result.strict_f1 == pytest.approx(2 / 3)
    # A detection the noisy runs never produced is still held against the candidate.
    elsewhere = [one_image([[600.0, 0.0, 700.0, 100.0], *stable], [0.9, 0.6, 0.5])]
    result = compare_detections(reference, elsewhere, noisy=noisy)
    assert not result.passed and result.excused == 1  # A, which the noise dropped


def test_a_detection_taking_the_room_a_rounding_flip_left_at_the_cut_is_excused():
    # The reference's last detection (0.5001) is one its own rounding noise drops; the
    # candidate's list gave that room to the next box (0.4999). Knowing the noise must
    # not undo the excuse the swap at the cut has without it.
    top3 = lambda each: [{k: v[:3] for k, v in each.items()}]  # noqa: E731
    reference = top3(_ranked([0.9, 0.7, 0.5001, 0.0]))
    noisy = [[{k: v[:2] for k, v in _ranked([0.9, 0.7]).items()}]]
    swapped = _ranked([0.9, 0.7003, 0.0, 0.4999])
    candidate = [{k: v[[0, 1, 3]] for k, v in swapped.items()}]
    assert compare_detections(reference, candidate, score_atol=1e-3).passed
    result = compare_detections(reference, candidate, score_atol=1e-3, noisy=noisy)
    assert result.passed and result.excused == 2, result.summary()
    # A box far below the cut did not take that room: it stays held against the candidate.
    swapped = _ranked([0.9, 0.7003, 0.0, 0.3])
    below = [{k: v[[0, 1, 3]] for k, v in swapped.items()}]
    result = compare_detections(reference, below, score_atol=1e-3, noisy=noisy)
    assert not result.passed and result.excused == 1, result.summary()


def test_a_box_moved_with_its_score_untouched_is_no_near_tie():
    # One of twenty boxes moved (IoU 0.6 with where it belongs), every score
    # bit-identical: nothing was rounded, so no NMS choice can have flipped.
    boxes = [[i * 200.0, 0.0, i * 200.0 + 100.0, 100.0] for i in range(20)]
    scores = [0.9 - 0.01 * i for i in range(20)]
    moved = [list(box) for box in boxes]
    moved[3] = [600.0 + 25.0, 0.0, 700.0 + 25.0, 100.0]
    result = compare_detections([one_image(boxes, scores)], [one_image(moved, scores)])
    assert not result.passed and result.excused == 0, result.summary()
