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


class OddOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)

    def forward(self, x):
        y = self.conv(x).mean((2, 3))
        return y, None, {"label": y.argmax(1), "none": None, "positive": y > 0}


def test_nones_among_the_outputs_come_back_in_place():
    net = OddOutputs().eval()
    candidate = built_on(net, torch.randn(2, 3, 8, 8))
    x = torch.randn(3, 3, 8, 8)
    scores, nothing, named = candidate(x)
    with torch.no_grad():
        expected = net(x)
    assert nothing is None and named["none"] is None
    torch.testing.assert_close(scores, expected[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(named["label"], expected[2]["label"])
    assert torch.equal(named["positive"], expected[2]["positive"])


def test_outputs_are_named_and_their_batch_is_free_like_the_inputs(tmp_path, capfd):
    import onnx

    from bladesmith.runtimes.onnxruntime import cpu_runner, export_onnx

    net = OddOutputs().eval()
    path = tmp_path / "odd.onnx"
    spec, nones = export_onnx(net, (torch.randn(2, 3, 8, 8),), path)
    assert nones == (1, 3)
    outputs = onnx.load(str(path)).graph.output
    assert [o.name for o in outputs] == ["output_0", "output_1", "output_2"]
    assert {o.type.tensor_type.shape.dim[0].dim_param for o in outputs} == {"batch"}
    capfd.readouterr()
    cpu_runner(path, spec, nones)(torch.randn(5, 3, 8, 8))
    assert "does not match" not in capfd.readouterr().err  # ONNX Runtime's shape warning


class Flags(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, negate: bool, repeat: int):
        y = self.linear(x)
        for _ in range(repeat):
            y = y * 2
        return -y if negate else y


def test_non_tensor_arguments_skip_the_pass_with_the_values_named():
    x = torch.randn(2, 4)
    reason = OnnxRuntime().skip_reason(Candidate(Flags().eval(), CPU), context_for((x, True, 1)))
    assert "non-tensor arguments (negate=True, repeat=1)" in reason


def test_a_runner_exported_with_constant_arguments_refuses_other_values():
    from bladesmith.errors import BladesmithError
    from bladesmith.runtimes.onnxruntime import fixed_shape_runner

    net, x = Flags().eval(), torch.randn(2, 4)
    runner = fixed_shape_runner(net, (x, True, 1))
    with torch.no_grad():
        torch.testing.assert_close(runner(x, negate=True, repeat=1), net(x, True, 1))
    with pytest.raises(BladesmithError, match="negate=False: .*exported with negate=True"):
        runner(x, False, 1)
    with pytest.raises(BladesmithError, match="repeat=2: .*exported with repeat=1"):
        runner(x, True, repeat=2)
    with pytest.raises(BladesmithError, match="^not given: .*exported with repeat=1"):
        runner(x, True)


def test_test_data_of_two_sizes_skips_the_pass_with_the_sizes():
    net = mobilenet_v3_small(weights=None).eval()
    context = context_for((torch.randn(2, 3, 32, 32),))
    context.test_args.append((torch.randn(1, 3, 48, 48),))
    reason = OnnxRuntime().skip_reason(Candidate(net, CPU), context)
    assert "more than one size past the batch ((3, 32, 32) and (3, 48, 48))" in reason


def test_another_image_size_is_refused_in_one_line_with_what_to_do():
    from bladesmith.errors import BladesmithError

    candidate = built_on(mobilenet_v3_small(weights=None), torch.randn(1, 3, 64, 64))
    with pytest.raises(BladesmithError) as raised:
        candidate(torch.randn(1, 3, 96, 96))
    message = str(raised.value)
    assert "got shape (1, 3, 96, 96) float32" in message
    assert "exported for (batch, 3, 64, 64) float32" in message
    assert "test data of this size" in message and "\n" not in message


class OptionalBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, bias=None):
        y = self.linear(x)
        return y if bias is None else y + bias


def test_a_tensor_argument_the_export_never_saw_is_refused_in_one_line():
    """The graph has no input for it: before, "the model takes 1 inputs; got 2"."""
    from bladesmith.errors import BladesmithError

    x = torch.rand(2, 4)
    result = built_on(OptionalBias(), x)
    torch.testing.assert_close(result(x), OptionalBias.forward(result.module, x))
    with pytest.raises(BladesmithError, match=r"^bias: this ONNX model was exported from calls "):
        result(x, bias=torch.ones(3))
