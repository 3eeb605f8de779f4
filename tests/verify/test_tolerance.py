"""verify.tolerance: defaults by dtype, and the floor of detection scores."""

from __future__ import annotations

import pytest
import torch
from verify_testing import make_detections

from bladesmith.verify import (
    compare_detections,
    compare_outputs,
    compare_tensors,
    default_tolerance,
    detection_score_tolerance,
)


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


def test_default_score_tolerance_follows_the_scores_dtype():
    reference = [make_detections()]
    half = [{**reference[0], "scores": reference[0]["scores"].half()}]
    result = compare_detections(reference, half)
    rtol, atol = default_tolerance(torch.float16)
    assert result.score_atol == pytest.approx(rtol + atol)
    assert result.passed


def test_detection_score_tolerance_has_a_floor_for_tf32():
    assert detection_score_tolerance(torch.float32) == 5e-3
    assert detection_score_tolerance(torch.float16) == pytest.approx(1.1e-2)


def test_noise_tolerances_are_ten_times_the_spread_never_below_rounding_at_scale():
    from bladesmith.verify import noise_tolerances

    reference = {"out[0]": torch.tensor([1.0, -2.0]), "out[1]": torch.tensor([4.0, 0.0])}
    runs = [
        {"out[0]": torch.tensor([1.0 + 1e-6, -2.0]), "out[1]": torch.tensor([4.0, 0.0])},
        {"out[0]": torch.tensor([1.0, -2.0 - 3e-6]), "out[1]": torch.tensor([4.0, 0.0])},
    ]
    measured = noise_tolerances(reference, runs, rtol=1e-4, unit=2.0**-23, unit_name="float32")
    assert measured.tolerances["out[0]"].atol == pytest.approx(10 * 3e-6, rel=0.05)
    # Unmoved by the noise: rounding at the output's own scale (4), ten times.
    assert measured.tolerances["out[1]"].atol == pytest.approx(10 * 4 * 2.0**-23)
    assert measured.atol == measured.tolerances["out[0]"].atol and measured.rtol == 1e-4
    assert "10 x the most (3.1e-06)" in measured.why


def test_half_precision_tolerances_use_their_types_rounding_and_margin():
    from bladesmith.verify import noise_tolerances
    from bladesmith.verify.tolerance import HALF_NOISE_MARGIN, half_unit

    assert half_unit(torch.float16) == 2.0**-11 and half_unit(torch.bfloat16) == 2.0**-8
    reference = {"out": torch.tensor([1.0, -8.0])}
    runs = [{"out": torch.tensor([1.0 + 1e-3, -8.0])}]
    measured = noise_tolerances(
        reference,
        runs,
        rtol=1e-2,
        unit=half_unit(torch.float16),
        unit_name="float16",
        margin=HALF_NOISE_MARGIN,
        computed_in="float16",
    )
    # The larger of the spread (1e-3) and rounding at the output's scale (8 x 2^-11).
    assert measured.atol == pytest.approx(HALF_NOISE_MARGIN * 8 * 2.0**-11)
    assert measured.why.startswith("float16 outputs within rtol 0.01")
    assert f"{HALF_NOISE_MARGIN:g} x the most" in measured.why


def test_a_half_precision_tolerance_never_exceeds_its_outputs_spread():
    """A huge-magnitude output (1e6, varying by 10) moves by thousands when bfloat16
    rounds the weights: the tolerance stays at 5% of its range, not 4 x that."""
    from bladesmith.verify import noise_tolerances
    from bladesmith.verify.tolerance import HALF_NOISE_MARGIN, HALF_SPREAD_CEILING, half_unit

    reference = {"out[0]": 1e6 + torch.linspace(0, 10, 50), "out[1]": torch.linspace(-3, 3, 50)}
    runs = [{"out[0]": reference["out[0]"] + 5000.0, "out[1]": reference["out[1]"] + 0.01}]
    measured = noise_tolerances(
        reference,
        runs,
        rtol=5e-2,
        unit=half_unit(torch.bfloat16),
        unit_name="bfloat16",
        margin=HALF_NOISE_MARGIN,
        computed_in="bfloat16",
    )
    huge, small = measured.tolerances["out[0]"], measured.tolerances["out[1]"]
    assert huge.atol == pytest.approx(HALF_SPREAD_CEILING * 10) == huge.ceiling
    assert "capped at 5% of its range 10" in huge.source
    # Where rounding moves less, it decides: 4 x rounding at the output's scale (3).
    assert small.atol == pytest.approx(HALF_NOISE_MARGIN * 3 * 2.0**-8)
    assert "under the ceiling of 5% of its range 6" in small.source
    assert measured.atol == huge.atol and "(1 of 2 capped there)" in measured.why
    # The ceiling holds against rtol too: 5% of 1e6 would allow 5e4.
    result = compare_outputs(
        (reference["out[0]"],), (reference["out[0]"] + 100,), tolerances={0: huge}
    )
    assert not result.passed
    float32 = noise_tolerances(reference, runs, rtol=1e-4, unit=2.0**-23, unit_name="float32")
    assert float32.tolerances["out[0]"].ceiling is None  # float32 is judged by rounding alone


def test_outputs_computed_in_half_precision_are_capped_without_a_measure():
    reference = {"energy": 1e6 + torch.linspace(0, 10, 50), "labels": torch.arange(50)}
    candidate = {"energy": reference["energy"] + 100, "labels": torch.arange(50)}
    rtol, atol = default_tolerance(torch.bfloat16)
    assert compare_outputs(reference, candidate, rtol=rtol, atol=atol).passed
    capped = compare_outputs(reference, candidate, rtol=rtol, atol=atol, computed_in=torch.bfloat16)
    assert not capped.passed
    energy = capped.outputs["out['energy']"]
    assert energy.ceiling == pytest.approx(0.5)
    assert energy.source == "given, at most 5% of its range 10 in bfloat16 (0.5)"
    assert capped.outputs["out['labels']"].source == "exact: int64 outputs must be equal"


def test_detection_scores_are_never_allowed_a_tenth_of_their_range():
    from bladesmith.verify.tolerance import detection_score_rule

    assert detection_score_tolerance(torch.bfloat16, judged_at=1100.0) == 0.1
    value, source = detection_score_rule(torch.bfloat16, judged_at=1100.0)
    assert value == 0.1 and "ceiling" in source
    assert (
        detection_score_rule(torch.float32)[1] == "scores within 0.005: floor for TF32 convolutions"
    )
