"""inductor: mode by level, skips, and a CPU compile at o2."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.passes import Candidate
from bladesmith.passes.inductor import Inductor, compile_mode
from engine_testing import (
    context_for,
)


def test_inductor_mode_by_level_and_skips():
    assert compile_mode("o2") == "max-autotune-no-cudagraphs"
    assert compile_mode("o1") == "default"
    candidate = Candidate(module=nn.Linear(2, 2), device=torch.device("cpu"))
    assert "level o2" in Inductor().skip_reason(candidate, context_for((), level="o1"))
    scripted = Candidate(module=torch.jit.script(nn.Linear(2, 2)), device=torch.device("cpu"))
    assert "TorchScript" in Inductor().skip_reason(scripted, context_for((), level="o2"))


def test_inductor_compiles_on_cpu_at_o2():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    x = torch.randn(4, 8)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    compiled = Inductor().apply(candidate, context_for((x,), level="o2"))
    assert compiled.backend == "inductor"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
