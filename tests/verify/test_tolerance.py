"""verify.tolerance: defaults by dtype, and the floor of detection scores."""

from __future__ import annotations

import pytest
import torch
from verify_testing import make_detections

from bladesmith.verify import (
    compare_detections,
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
