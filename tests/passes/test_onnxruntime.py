"""onnxruntime: the module's output structure survives the export."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.passes import Candidate
from bladesmith.passes.onnxruntime import OnnxRuntime
from engine_testing import (
    context_for,
)


def test_onnxruntime_keeps_the_output_structure():
    class TwoOutputs(nn.Module):
        def forward(self, x):
            return {"double": x * 2, "pair": (x + 1, x.sum(dim=1))}

    x = torch.randn(2, 3)
    candidate = Candidate(module=TwoOutputs(), device=torch.device("cpu"))
    out = OnnxRuntime().apply(candidate, context_for((x,)))(x)
    torch.testing.assert_close(out["double"], x * 2)
    torch.testing.assert_close(out["pair"][1], x.sum(dim=1))
