"""fp16/bf16: a copy in half precision that returns float32."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.passes import Candidate
from bladesmith.passes.precision import AutocastFloats, BFloat16, CastFloats, Float16
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


class MeanSubtracted(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.full((1, 3, 1, 1), 0.5))

    def forward(self, x):
        return self.conv(x - self.mean.to(x.dtype)).relu()


def test_a_trace_with_float32_casts_runs_under_autocast():
    """Traced on float32 inputs, ``mean.to(x.dtype)`` casts to float32 for good: the
    half copy meets float32 activations and fails, so the pass runs the model (weights
    untouched) under torch.autocast, in bfloat16 convolutions."""
    torch.manual_seed(0)
    eager = MeanSubtracted().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        traced = torch.jit.trace(eager, (x,))
    candidate = Candidate(module=traced, device=torch.device("cpu"))
    context = context_for((x,))
    half = BFloat16().apply(candidate, context)
    assert isinstance(half.module, AutocastFloats) and half.dtype == torch.bfloat16
    assert half.module.module is traced and traced.conv.weight.dtype == torch.float32
    assert any("torch.autocast" in note for note in context.notes)
    with torch.no_grad():
        got, expected = half(x), eager(x)
    assert got.dtype == torch.float32
    assert 0 < (got - expected).abs().max() < 0.05  # bfloat16 arithmetic: close, not equal


def test_a_trace_without_baked_casts_is_cast_as_a_module_is():
    x = torch.randn(3, 4)
    with torch.no_grad():
        traced = torch.jit.trace(nn.Linear(4, 2), (x,))
    half = BFloat16().apply(Candidate(module=traced, device=torch.device("cpu")), context_for((x,)))
    assert type(half.module) is CastFloats  # not its autocast subclass


def test_freezing_an_autocast_model_keeps_autocast_outside_the_frozen_graph():
    """A trace drops autocast: the torchscript pass freezes the model inside and runs
    the frozen graph under autocast again, so its convolutions stay in bfloat16."""
    from bladesmith.passes.torchscript import TorchScriptFreeze

    torch.manual_seed(0)
    eager = MeanSubtracted().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        traced = torch.jit.trace(eager, (x,))
    context = context_for((x,))
    half = BFloat16().apply(Candidate(module=traced, device=torch.device("cpu")), context)
    frozen = TorchScriptFreeze().apply(half, context)
    assert isinstance(frozen.runner, AutocastFloats)
    assert isinstance(frozen.runner.module, torch.jit.ScriptModule)
    with torch.no_grad():
        got, expected = frozen(x), eager(x)
    assert got.dtype == torch.float32
    assert 0 < (got - expected).abs().max() < 0.05


def test_bf16_is_tried_on_a_cpu_only_where_it_computes_in_bfloat16(monkeypatch):
    import bladesmith.passes.precision as precision

    candidate = Candidate(module=nn.Linear(4, 2), device=torch.device("cpu"))
    context = context_for((torch.randn(3, 4),))
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert "no bfloat16 arithmetic" in BFloat16().skip_reason(candidate, context)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert BFloat16().skip_reason(candidate, context) is None
    # The probe answers for this machine, whichever it is.
    assert isinstance(precision.cpu_has_bf16(), bool)
