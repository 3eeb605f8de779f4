"""The onnxruntime pass: the module's output structure survives the export, and the result
is a drop-in for any batch size, whatever batch it was built on."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import mobilenet_v3_small

from bladesmith.passes import Candidate
from bladesmith.passes.onnxruntime import OnnxRuntime
from bladesmith.runtimes.onnxruntime import OnnxRunnerPerShape
from engine_testing import context_for

pytest.importorskip("onnxruntime")
CPU = torch.device("cpu")


def built_on(net: nn.Module, x: torch.Tensor) -> Candidate:
    return OnnxRuntime().apply(Candidate(net.eval(), CPU), context_for((x,)))


def test_built_on_batch_1_runs_batch_2_like_the_model():
    net = mobilenet_v3_small(weights=None).eval()
    candidate = built_on(net, torch.randn(1, 3, 64, 64))
    assert candidate.backend == "onnxruntime"
    assert not isinstance(candidate.runner, OnnxRunnerPerShape)  # one dynamic session
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = net(x)
    result = candidate(x)
    assert result.shape == (2, 1000)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)


class FixedBatch(nn.Module):
    """A forward that bakes its example's batch size into a reshape, as some code does
    with ``x.view(1, -1)``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 3)

    def forward(self, x):
        return self.linear(x.reshape(int(x.shape[0]), -1))


def test_a_graph_that_fixes_its_batch_gets_a_session_per_shape():
    net = FixedBatch().eval()
    candidate = built_on(net, torch.randn(1, 3, 4))
    assert isinstance(candidate.runner, OnnxRunnerPerShape)
    for batch in (1, 3, 1):
        x = torch.randn(batch, 3, 4)
        with torch.no_grad():
            torch.testing.assert_close(candidate(x), net(x), rtol=1e-5, atol=1e-5)
    assert len(candidate.runner.runners) == 2


class SelfAttention(nn.Module):
    """Self-attention as torchvision's ViT calls it: under no_grad in eval mode it takes
    nn.MultiheadAttention's fused fast path, an operator ONNX has no translation for."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


def test_multi_head_attention_exports_without_its_fused_fast_path():
    net = SelfAttention().eval()
    candidate = built_on(net, torch.randn(1, 5, 16))
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(candidate(x), net(x), rtol=1e-4, atol=1e-5)
    assert torch.backends.mha.get_fastpath_enabled()  # restored after the export


def test_onnxruntime_keeps_the_output_structure():
    class TwoOutputs(nn.Module):
        def forward(self, x):
            return {"double": x * 2, "pair": (x + 1, x.sum(dim=1))}

    x = torch.randn(2, 3)
    candidate = Candidate(module=TwoOutputs(), device=torch.device("cpu"))
    out = OnnxRuntime().apply(candidate, context_for((x,)))(x)
    torch.testing.assert_close(out["double"], x * 2)
    torch.testing.assert_close(out["pair"][1], x.sum(dim=1))
