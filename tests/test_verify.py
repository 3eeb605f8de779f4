import json
import math

import numpy as np
import pytest
import torch

from bladesmith.engine.reference import reference_under_noise
from bladesmith.verify import (
    Comparison,
    Tolerance,
    compare_detections,
    compare_outputs,
    compare_tensors,
    default_tolerance,
    detection_score_tolerance,
)


def strict_json(data) -> str:
    return json.dumps(data, allow_nan=False)


# --- tolerances by dtype ---------------------------------------------------------------


def test_default_tolerances_by_dtype():
    assert default_tolerance(torch.float32) == (1e-4, 1e-5)
    assert default_tolerance(torch.float16) == (1e-2, 1e-3)
    assert default_tolerance(torch.bfloat16) == (5e-2, 1e-2)
    assert default_tolerance(torch.complex64) == default_tolerance(torch.float32)
    for exact in (torch.int64, torch.int32, torch.uint8, torch.bool):
        assert default_tolerance(exact) == (0.0, 0.0)
    eps = torch.finfo(torch.float8_e4m3fn).eps
    assert default_tolerance(torch.float8_e4m3fn) == (10 * eps, eps)


def test_fp16_noise_passes_with_fp16_default_but_not_with_fp32_tolerance():
    reference = torch.randn(64, 75, generator=torch.Generator().manual_seed(0)) * 4
    candidate = reference.half()  # rounding noise of a half-precision run
    default = compare_tensors(reference, candidate)
    assert default.passed, default.summary()
    assert (default.rtol, default.atol) == default_tolerance(torch.float16)
    strict = compare_tensors(reference, candidate, *default_tolerance(torch.float32))
    assert not strict.passed
    assert strict.out_of_tolerance > 0
    assert strict.tolerance_ratio > 1
    assert "out of tolerance" in strict.summary() and "its tolerance" in strict.summary()


# --- statistics ------------------------------------------------------------------------


def test_error_statistics_match_numpy():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(40, 120)).astype(np.float32)
    ref[0, :5] = 0.0  # relative error is undefined there and left out
    cand = ref + rng.normal(scale=3e-5, size=ref.shape).astype(np.float32)
    result = compare_tensors(torch.from_numpy(ref), torch.from_numpy(cand))

    abs_err = np.abs(cand.astype(np.float64) - ref.astype(np.float64))
    nonzero = ref != 0
    rel_err = abs_err[nonzero] / np.abs(ref.astype(np.float64))[nonzero]
    assert result.numel == ref.size
    assert result.max_abs == pytest.approx(abs_err.max())
    assert result.mean_abs == pytest.approx(abs_err.mean())
    assert result.p99_abs == pytest.approx(np.percentile(abs_err, 99))
    assert result.max_rel == pytest.approx(rel_err.max())
    assert result.mean_rel == pytest.approx(rel_err.mean())
    assert result.p99_rel == pytest.approx(np.percentile(rel_err, 99))
    expected_bad = int((~np.isclose(cand, ref, rtol=1e-4, atol=1e-5)).sum())
    assert expected_bad > 0
    assert result.out_of_tolerance == expected_bad
    assert result.passed is False


def test_tolerance_ratio_says_how_far_past_the_tolerance():
    result = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0 + 3e-4, 2.0]))
    # allowed at 1.0: atol 1e-5 + rtol 1e-4 * 1.0 = 1.1e-4
    assert result.tolerance_ratio == pytest.approx(3e-4 / 1.1e-4, rel=1e-3)
    assert result.out_of_tolerance == 1
    assert "2.73x its tolerance" in result.summary()


def test_explicit_tolerances_are_used_and_reported():
    result = compare_tensors(torch.ones(10), torch.ones(10) * 1.05, rtol=0.1, atol=0.0)
    assert result.passed
    assert (result.rtol, result.atol) == (0.1, 0.0)
    assert "rtol 0.1" in result.summary()
    with pytest.raises(ValueError, match="tolerances must be >= 0"):
        compare_tensors(torch.ones(1), torch.ones(1), rtol=-1)


def test_integers_must_be_equal():
    assert compare_tensors(torch.arange(6), torch.arange(6).int()).passed
    result = compare_tensors(torch.arange(6), torch.tensor([0, 1, 2, 3, 4, 9]))
    assert not result.passed
    assert result.out_of_tolerance == 1
    assert result.tolerance_ratio == math.inf
    assert "1/6 differ" in result.summary()
    assert result.to_dict()["tolerance_ratio"] is None


def test_large_int64_values_compare_exactly():
    big = torch.tensor([2**62 + 1], dtype=torch.int64)
    assert not compare_tensors(big, big + 1).passed  # equal in float64, not in int64


def test_nan_handling():
    nan, inf = math.nan, math.inf
    reference = torch.tensor([1.0, nan, inf, -inf])
    assert compare_tensors(reference, reference.clone()).passed

    moved_nan = compare_tensors(reference, torch.tensor([nan, 2.0, inf, -inf]))
    assert not moved_nan.passed
    assert moved_nan.nonfinite_mismatches == 2
    assert moved_nan.out_of_tolerance == 2
    assert "NaN/inf mismatches" in moved_nan.summary()

    flipped_inf = compare_tensors(reference, torch.tensor([1.0, nan, -inf, -inf]))
    assert not flipped_inf.passed
    assert flipped_inf.nonfinite_mismatches == 1
    strict_json(flipped_inf.to_dict())


def test_shape_and_kind_mismatches_fail_with_reasons():
    shape = compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2))
    assert not shape.passed
    assert "shape [3, 2] differs from the reference's [2, 3]" in shape.summary()

    kind = compare_tensors(torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    assert not kind.passed
    assert "int64 is not comparable" in kind.summary()


def test_empty_tensors_match():
    result = compare_tensors(torch.zeros(0, 4), torch.zeros(0, 4))
    assert result.passed and result.max_abs is None
    strict_json(result.to_dict())


def test_bf16_candidate_of_fp32_reference_uses_bf16_tolerance():
    reference = torch.linspace(-3, 3, 500)
    result = compare_tensors(reference, reference.bfloat16())
    assert result.passed
    assert (result.rtol, result.atol) == default_tolerance(torch.bfloat16)
    assert result.to_dict()["dtype"] == "bfloat16"
    assert result.to_dict()["reference_dtype"] == "float32"


# --- detections ------------------------------------------------------------------------


def make_detections(n=50, seed=0, num_classes=5):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 500
    wh = 20 + torch.rand(n, 2, generator=g) * 100
    return {
        "boxes": torch.cat([xy, xy + wh], dim=1),
        "scores": torch.rand(n, generator=g),
        "labels": torch.randint(0, num_classes, (n,), generator=g),
    }


def take(detections, index):
    return {key: value[index] for key, value in detections.items()}


def test_shuffled_detections_match_perfectly():
    reference = [make_detections(seed=1), make_detections(seed=2)]
    candidate = [take(d, torch.randperm(len(d["scores"]))) for d in reference]
    result = compare_detections(reference, candidate)
    assert result.passed, result.summary()
    assert result.f1 == 1.0 and result.matched == 100
    assert result.max_box_deviation == 0.0 and result.max_score_deviation == 0.0
    assert result.mean_iou == pytest.approx(1.0)


def test_small_box_and_score_deviations_are_reported():
    reference = [make_detections()]
    candidate = [dict(reference[0])]
    candidate[0]["boxes"] = reference[0]["boxes"] + torch.tensor([0.5, 0.0, 0.0, -0.25])
    candidate[0]["scores"] = reference[0]["scores"] + 5e-5
    result = compare_detections(reference, candidate)
    assert result.passed
    assert result.max_box_deviation == pytest.approx(0.5)
    assert result.max_score_deviation == pytest.approx(5e-5, rel=1e-2)
    assert "max box dev 0.5 px" in result.summary()

    too_far = compare_detections(reference, candidate, score_atol=1e-5)
    assert not too_far.passed
    assert "a matched score moved by 5e-5" in too_far.summary()
    assert too_far.tolerance_ratio == pytest.approx(5.0, rel=1e-2)


def test_shifted_boxes_fall_below_iou_and_fail():
    reference = [make_detections()]
    shifted = dict(reference[0], boxes=reference[0]["boxes"] + 15.0)
    result = compare_detections(reference, [shifted])
    assert not result.passed
    assert result.f1 < 0.99
    assert "below 0.99" in result.summary()


def test_class_swap_does_not_match():
    reference = [make_detections(n=10)]
    swapped = dict(reference[0], labels=(reference[0]["labels"] + 1) % 5)
    result = compare_detections(reference, [swapped])
    assert not result.passed
    assert result.matched == 0 and result.f1 == 0.0


def test_one_missed_detection_in_many_is_within_min_f1():
    reference = [make_detections(n=200)]
    candidate = [take(reference[0], torch.arange(1, 200))]
    result = compare_detections(reference, candidate)
    assert result.recall == pytest.approx(199 / 200) and result.precision == 1.0
    assert result.f1 == pytest.approx(2 * 0.995 / 1.995)
    assert result.passed
    assert not compare_detections(reference, candidate, min_f1=1.0).passed


def test_matching_is_one_to_one():
    reference = [take(make_detections(n=1), torch.tensor([0]))]
    duplicate = [take(reference[0], torch.tensor([0, 0]))]
    result = compare_detections(reference, duplicate)
    assert result.matched == 1
    assert result.precision == 0.5 and result.recall == 1.0


def test_matching_stays_within_each_image():
    first, second = make_detections(seed=3), make_detections(seed=4)
    assert not compare_detections([first, second], [second, first]).passed


def test_empty_detections():
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0)}
    assert compare_detections([empty], [empty]).f1 == 1.0
    missed = compare_detections([make_detections(n=3)], [empty])
    assert not missed.passed and missed.recall == 0.0


def test_nonfinite_candidate_detections_match_nothing():
    reference = [make_detections(n=4)]
    broken = dict(reference[0], scores=reference[0]["scores"].clone())
    broken["scores"][0] = math.nan
    result = compare_detections(reference, [broken], min_f1=0.5)
    assert result.matched == 3
    assert not result.passed
    assert "1 candidate detections have NaN/inf" in result.summary()
    strict_json(result.to_dict())


def test_malformed_detections():
    reference = [make_detections(n=3)]
    with pytest.raises(ValueError, match=r"reference\[0\]: expected boxes \[n, 4\]"):
        compare_detections([dict(reference[0], boxes=torch.zeros(3, 5))], reference)
    result = compare_detections(reference, [{"boxes": torch.zeros(3, 4)}])
    assert not result.passed
    assert "candidate[0]: expected a dict with keys" in result.summary()
    images = compare_detections(reference, reference * 2)
    assert not images.passed and "2 images of detections" in images.summary()


def test_default_score_tolerance_follows_the_scores_dtype():
    reference = [make_detections()]
    half = [{**reference[0], "scores": reference[0]["scores"].half()}]
    result = compare_detections(reference, half)
    rtol, atol = default_tolerance(torch.float16)
    assert result.score_atol == pytest.approx(rtol + atol)
    assert result.passed


# --- structured outputs ----------------------------------------------------------------


def test_nested_structures_are_compared_by_path():
    reference = (torch.ones(3), {"boxes": torch.zeros(2, 4), "labels": torch.arange(2)})
    candidate = (torch.ones(3), {"boxes": torch.zeros(2, 4) + 1, "labels": torch.arange(2)})
    result = compare_outputs(reference, candidate)
    assert isinstance(result, Comparison)
    assert list(result.outputs) == ["out[0]", "out[1]['boxes']", "out[1]['labels']"]
    assert not result.passed
    assert result.summary().startswith("out[1]['boxes']: max abs 1")
    data = result.to_dict()
    assert data["outputs"]["out[1]['labels']"]["passed"] is True
    strict_json(data)


def test_detection_lists_inside_structures_use_detection_matching():
    detections = [make_detections(seed=5)]
    shuffled = [take(detections[0], torch.randperm(50))]
    result = compare_outputs((detections, torch.ones(2)), (shuffled, torch.ones(2)))
    assert result.passed, result.summary()
    assert result.outputs["out[0]"].to_dict()["kind"] == "detections"
    assert result.summary().startswith("all 2 outputs within tolerance")


def test_structure_mismatches_fail_with_reasons():
    cases = [
        ((torch.ones(1), torch.ones(1)), (torch.ones(1),), "out: 1 items, the reference has 2"),
        ({"a": torch.ones(1)}, {"b": torch.ones(1)}, "keys ['b'] differ"),
        ({"a": torch.ones(1)}, [torch.ones(1)], "out: expected a dict, got list"),
        ([torch.ones(1)], torch.ones(1), "out: expected a sequence, got Tensor"),
        ((torch.ones(1),), ("x",), "out[0]: expected a tensor, got str"),
        ((None, "a"), (None, "b"), "out[1]: 'b' differs"),
    ]
    for reference, candidate, reason in cases:
        result = compare_outputs(reference, candidate)
        assert not result.passed
        assert reason in result.summary()
        assert result.tolerance_ratio == math.inf


def test_numbers_and_arrays_are_compared_as_tensors():
    result = compare_outputs({"n": 3, "x": np.ones(2)}, {"n": 3, "x": np.ones(2)})
    assert result.passed and len(result.outputs) == 2
    with pytest.raises(TypeError, match="cannot compare outputs of type object"):
        compare_outputs(object(), object())


def test_per_output_tolerance_overrides():
    reference = (torch.ones(4), {"logits": torch.ones(4)})
    candidate = (torch.ones(4) * 1.01, {"logits": torch.ones(4) * 1.01})
    assert not compare_outputs(reference, candidate).passed
    assert not compare_outputs(reference, candidate, tolerances={0: Tolerance(rtol=0.05)}).passed
    by_key = compare_outputs(
        reference,
        candidate,
        tolerances={0: Tolerance(rtol=0.05), "logits": Tolerance(atol=0.02)},
    )
    assert by_key.passed
    assert by_key.outputs["out[1]['logits']"].rtol == 1e-4  # default kept where not set
    # The full path wins over the last key.
    full = compare_outputs(
        reference,
        candidate,
        rtol=0.05,
        tolerances={"logits": Tolerance(rtol=0.05), "out[1]['logits']": Tolerance(rtol=1e-6)},
    )
    assert full.outputs["out[0]"].passed
    assert not full.outputs["out[1]['logits']"].passed
    with pytest.raises(ValueError, match=r"no output is named \['scores'\]"):
        compare_outputs(reference, candidate, tolerances={"scores": Tolerance(rtol=1)})


def test_fp16_outputs_against_fp32_reference():
    g = torch.Generator().manual_seed(2)
    reference = {"features": torch.randn(8, 256, generator=g), "count": torch.tensor(8)}
    candidate = {"features": reference["features"].half(), "count": torch.tensor(8)}
    result = compare_outputs(reference, candidate)
    assert result.passed, result.summary()
    assert result.outputs["out['features']"].rtol == 1e-2


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


def test_detection_score_tolerance_has_a_floor_for_tf32():
    assert detection_score_tolerance(torch.float32) == 5e-3
    assert detection_score_tolerance(torch.float16) == pytest.approx(1.1e-2)


def _image(boxes, scores):
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32),
        "scores": torch.tensor(scores),
        "labels": torch.zeros(len(scores), dtype=torch.int64),
    }


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
    reference = [_image([[0.0, 0.0, 100.0, 100.0], low], [0.8, 0.1])]
    candidate = [_image([shifted_box, low], [shifted_score, 0.1004])]  # rounding: 4e-4
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert result.passed is excused, result.summary()
    assert result.excused == (2 if excused else 0)


def test_near_ties_are_judged_by_what_rounding_really_moved():
    # Same swap as above, but the matched scores are bit-identical: nothing was
    # rounded differently, so a 5e-4 gap is no tie, whatever score_atol allows.
    low = [300.0, 300.0, 400.0, 400.0]
    reference = [_image([[0.0, 0.0, 100.0, 100.0], low], [0.8, 0.1])]
    candidate = [_image([[10.0, 0.0, 110.0, 100.0], low], [0.7995, 0.1])]
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
    reference = [_image([a, low], [0.8, 0.1])]
    candidate = [_image([b, neighbour, low], [0.8002, 0.5, 0.1003])]  # rounding: 3e-4
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
    reference = [_image([a, n2, low], [0.8, 0.45, 0.1])]
    candidate = [_image([b, n1, low], [0.8002, 0.5, 0.1003])]  # rounding: 3e-4
    result = compare_detections(reference, candidate, score_atol=1e-3)
    assert result.passed, result.summary()
    assert result.excused == 4
    # Without the tie that starts it, the same chain is no excuse.
    untied = [_image([[500.0, 0.0, 600.0, 100.0], n1, low], [0.8002, 0.5, 0.1003])]
    assert compare_detections(reference, untied, score_atol=1e-3).excused == 0


def test_detections_the_reference_flips_under_rounding_noise_are_excused():
    # The reference keeps A; under rounding noise the model itself kept B instead (a
    # candidate at a cut inside the model): a candidate that keeps B is not at fault.
    a, b = [0.0, 0.0, 100.0, 100.0], [300.0, 0.0, 400.0, 100.0]
    stable = [[0.0, 300.0, 100.0, 400.0], [200.0, 300.0, 300.0, 400.0]]
    reference = [_image([a, *stable], [0.9, 0.6, 0.5])]
    noisy = [[_image([b, *stable], [0.9, 0.6, 0.5])]]
    candidate = [_image([b, *stable], [0.9, 0.6, 0.5])]
    assert not compare_detections(reference, candidate).passed
    result = compare_detections(reference, candidate, noisy=noisy)
    assert result.passed and result.excused == 2, result.summary()
    assert result.strict_f1 == pytest.approx(2 / 3)
    # A detection the noisy runs never produced is still held against the candidate.
    elsewhere = [_image([[600.0, 0.0, 700.0, 100.0], *stable], [0.9, 0.6, 0.5])]
    result = compare_detections(reference, elsewhere, noisy=noisy)
    assert not result.passed and result.excused == 1  # A, which the noise dropped


def test_reference_under_noise_moves_outputs_by_rounding_only_and_repeats():
    model = torch.nn.Linear(64, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = [(torch.randn(4, 64),)]
    first = reference_under_noise(model, inputs, runs=2)
    again = reference_under_noise(model, inputs, runs=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    exact = model(*inputs[0])
    for run, repeated in zip(first, again, strict=True):
        assert torch.equal(run[0], repeated[0])
        change = (run[0] - exact).abs().max() / exact.abs().max()
        assert 0 < change < 5e-3
    assert not torch.equal(first[0][0], first[1][0])


def test_compare_outputs_hands_each_detection_list_its_noisy_twins():
    a, b, low = [0.0, 0.0, 100.0, 100.0], [300.0, 0.0, 400.0, 100.0], [0.0, 300.0, 90.0, 400.0]
    reference = {"dets": [_image([a, low], [0.9, 0.5])], "n": torch.ones(1)}
    candidate = {"dets": [_image([b, low], [0.9, 0.5])], "n": torch.ones(1)}
    noisy = [{"dets": [_image([b, low], [0.9, 0.5])], "n": torch.ones(1)}]
    assert not compare_outputs(reference, candidate).passed
    assert compare_outputs(reference, candidate, noisy=noisy).passed


def test_a_box_moved_with_its_score_untouched_is_no_near_tie():
    # One of twenty boxes moved (IoU 0.6 with where it belongs), every score
    # bit-identical: nothing was rounded, so no NMS choice can have flipped.
    boxes = [[i * 200.0, 0.0, i * 200.0 + 100.0, 100.0] for i in range(20)]
    scores = [0.9 - 0.01 * i for i in range(20)]
    moved = [list(box) for box in boxes]
    moved[3] = [600.0 + 25.0, 0.0, 700.0 + 25.0, 100.0]
    result = compare_detections([_image(boxes, scores)], [_image(moved, scores)])
    assert not result.passed and result.excused == 0, result.summary()
