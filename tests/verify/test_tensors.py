"""verify.tensors: error statistics, exact integers, NaN and mismatches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verify_testing import strict_json

from bladesmith.verify import (
    compare_tensors,
    default_tolerance,
)


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


@pytest.mark.parametrize("dtype", [np.ulonglong, np.uint64, np.uint32, np.uint16, np.longlong])
def test_numpy_integer_arrays_of_every_alias_compare_exactly(dtype):
    """ONNX Runtime returns uint64 outputs as numpy's ulonglong, which torch does not
    take (on Linux numpy's uint64 is ulong); the values stay exact, beyond 2**63 too."""
    top = np.iinfo(dtype).max
    reference = np.array([0, 1, top], dtype=dtype)
    same = compare_tensors(reference, reference.copy())
    assert same.passed and same.dtype == np.dtype(dtype).name
    changed = reference.copy()
    changed[2:] -= np.ones(1, dtype=dtype)
    differs = compare_tensors(reference, changed)
    assert not differs.passed and differs.out_of_tolerance == 1


def test_a_big_endian_array_compares_by_value():
    reference = np.array([1, 2, 3], dtype=np.uint64)
    assert compare_tensors(reference.astype(">u8"), reference).passed


def test_integers_and_bools_are_exact_whatever_tolerance_is_asked_for():
    """Labels compared with a float tolerance let a class off by one pass."""
    labels = torch.tensor([3, 17, 1, 80])
    off_by_one = compare_tensors(labels, labels + torch.tensor([0, 1, 0, 0]), rtol=0.05, atol=1100)
    assert not off_by_one.passed and off_by_one.out_of_tolerance == 1
    assert (off_by_one.rtol, off_by_one.atol) == (0.0, 0.0)
    assert off_by_one.source == "exact: int64 outputs must be equal"
    mask = torch.tensor([[True, False], [False, True]])
    flipped = compare_tensors(mask, ~mask, rtol=1.0, atol=1.0, ceiling=5.0)
    assert not flipped.passed and flipped.source == "exact: bool outputs must be equal"


def test_a_ceiling_caps_what_rtol_and_atol_allow():
    reference = torch.tensor([1e6, 1e6 + 10.0])
    moved = reference + torch.tensor([0.0, 100.0])
    assert compare_tensors(reference, moved, rtol=5e-2, atol=1e-2).passed  # 5e4 allowed
    capped = compare_tensors(
        reference, moved, rtol=5e-2, atol=1e-2, ceiling=0.5, ceiling_source="5% of its range"
    )
    assert not capped.passed and capped.ceiling == 0.5
    assert capped.source == "given, at most 5% of its range (0.5)"
    assert "at most 0.5" in capped.summary()
    assert capped.to_dict()["ceiling"] == 0.5
