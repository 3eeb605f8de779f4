"""fp16/bf16: a copy in half precision that returns float32."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.passes import Candidate
from bladesmith.passes.precision import BFloat16, CastFloats, Float16
from engine_testing import (
    context_for,
)


def test_half_precision_wraps_a_copy_and_returns_float32():
    model = nn.Linear(4, 2)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    context = context_for((torch.randn(3, 4),))
    assert Float16().skip_reason(candidate, context) is None
    assert "fp16 was kept" in BFloat16().skip_reason(candidate, context_for((), kept=["fp16"]))
    half = BFloat16().apply(candidate, context)
    assert isinstance(half.module, CastFloats) and half.dtype == torch.bfloat16
    assert half.module.module.weight.dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32  # the candidate given is untouched
    out = half(torch.randn(3, 4))
    assert out.dtype == torch.float32
    assert "already computes in bfloat16" in Float16().skip_reason(half, context)
