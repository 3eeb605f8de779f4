"""The conv_fusion pass: the fused convolution operator, the rewrite, and its exports."""

from __future__ import annotations

import copy
import io

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torchvision.models.resnet import BasicBlock, Bottleneck

from bladesmith.artifact import OptimizedModule
from bladesmith.ops.build import unavailable
from bladesmith.passes import Candidate
from bladesmith.passes.conv_fusion import ConvFusion, FusedConv2dReLU, FusedResidualBlock, fuse
from bladesmith.passes.fixed_shape import FixedShape
from bladesmith.passes.head_packing import HeadPacking
from bladesmith.verify import compare_detections
from engine_testing import context_for, cuda, detections_through, randomize_norms

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")


def reference(x, weight, bias, residual, stride, padding, dilation, groups):
    y = F.conv2d(x.double(), weight.double(), bias.double(), stride, padding, dilation, groups)
    return (y if residual is None else y + residual.double()).relu()


@pytest.mark.parametrize(
    ("shape", "weight_shape", "stride", "padding", "dilation", "groups", "with_residual"),
    [
        ((2, 8, 11, 9), (16, 8, 3, 3), 1, 1, 1, 1, False),
        ((1, 8, 12, 10), (8, 8, 1, 1), 1, 0, 1, 1, True),
        ((1, 6, 13, 14), (12, 3, 3, 3), 2, 1, 1, 2, True),
        ((1, 4, 15, 15), (4, 4, 3, 3), 1, 2, 2, 1, False),
    ],
)
def test_conv2d_relu_matches_a_float64_reference(
    shape, weight_shape, stride, padding, dilation, groups, with_residual
):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(shape), torch.randn(weight_shape), torch.randn(weight_shape[0])
    expected_shape = reference(x, weight, bias, None, stride, padding, dilation, groups).shape
    residual = torch.randn(expected_shape) if with_residual else None
    args = (x, weight, bias, residual, [stride] * 2, [padding] * 2, [dilation] * 2, groups)
    out = torch.ops.bladesmith.conv2d_relu(*args)
    torch.testing.assert_close(out.double(), reference(*args), rtol=1e-5, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.bladesmith.conv2d_relu(*fake_args)
    assert fake.shape == out.shape and fake.stride() == out.stride()


def test_conv2d_relu_refuses_a_residual_of_another_shape_or_dtype():
    x, weight, bias = torch.randn(1, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.zeros(6)
    sizes = ([1, 1], [1, 1], [1, 1], 1)
    with pytest.raises(RuntimeError, match=r"residual has shape \[1, 6, 7, 8\], .*\[1, 6, 8, 8\]"):
        torch.ops.bladesmith.conv2d_relu(x, weight, bias, torch.zeros(1, 6, 7, 8), *sizes)
    with pytest.raises(RuntimeError, match="residual must have x's dtype"):
        torch.ops.bladesmith.conv2d_relu(
            x, weight, bias, torch.zeros(1, 6, 8, 8, dtype=torch.float64), *sizes
        )
    with pytest.raises(RuntimeError, match="must share a dtype"):
        torch.ops.bladesmith.conv2d_relu(x, weight.half(), bias, None, *sizes)


def fusable_net() -> nn.Module:
    """conv -> batch norm -> ReLU, a Bottleneck with a strided shortcut, a BasicBlock, a
    convolution + ReLU without a norm, and a last convolution that no ReLU follows."""
    torch.manual_seed(0)
    shortcut = nn.Sequential(nn.Conv2d(8, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
    return randomize_norms(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            Bottleneck(8, 8, stride=2, downsample=shortcut),
            BasicBlock(32, 32),
            nn.Sequential(nn.Conv2d(32, 16, 3, padding=1), nn.ReLU()),
            nn.Conv2d(16, 4, 1),
        )
    )


def test_apply_fuses_conv_norm_relu_and_residual_blocks_and_keeps_the_outputs():
    model = fusable_net()
    x = torch.randn(2, 3, 17, 20)
    context = context_for((x,))
    result = ConvFusion().apply(Candidate(module=model, device=torch.device("cpu")), context)
    net = result.module
    assert isinstance(net[0], FusedConv2dReLU)
    assert isinstance(net[1], nn.Identity) and isinstance(net[2], nn.Identity)
    assert isinstance(net[3], FusedResidualBlock) and len(net[3].convs) == 3
    assert isinstance(net[4], FusedResidualBlock) and len(net[4].convs) == 2
    assert type(net[3].downsample[0]) is nn.Conv2d  # no ReLU follows: left as it is
    assert isinstance(net[5][0], FusedConv2dReLU) and isinstance(net[5][1], nn.Identity)
    assert type(net[6]) is nn.Conv2d
    assert result.applied == ("conv_fusion",)
    assert isinstance(model[3], Bottleneck)  # the candidate given is untouched
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x), rtol=1e-4, atol=1e-4)
    assert "4 convolution + ReLU sites" in context.notes[-1]
    assert "(3, 4, 0, 5.0)" in context.notes[-1]


def test_skips_models_without_a_convolution_followed_by_a_relu():
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sigmoid())
    context = context_for((torch.randn(1, 3, 8, 8),))
    reason = ConvFusion().skip_reason(Candidate(plain, torch.device("cpu")), context)
    assert reason in ("the model has no convolution followed by a ReLU", "cuDNN is not available")
    assert ConvFusion.rewrites_modules  # the engine skips it for TorchScript modules


def test_fused_model_exports_plain_convolutions_to_onnx_and_keeps_the_operator_traced():
    net = fusable_net()
    fuse(net)
    x = torch.randn(1, 3, 16, 16)
    buffer = io.BytesIO()
    torch.onnx.export(net, (x,), buffer, dynamo=False, opset_version=17)
    ops = {node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node}
    assert "Conv" in ops and "Relu" in ops and all("conv2d_relu" not in op for op in ops)
    exported = torch.export.export(net, (x,))
    targets = {str(node.target) for node in exported.graph.nodes}
    assert "bladesmith.conv2d_relu.default" in targets
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.trace(net, (x,)), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    assert "bladesmith::conv2d_relu" in loaded.inlined_graph.str()
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), net(x))
        torch.testing.assert_close(loaded(x), net(x))


def test_detector_with_a_packed_head_is_fused_where_both_heads_see_it(detector):
    model, photos = detector
    context = context_for((photos,))
    candidate = FixedShape().apply(Candidate(copy.deepcopy(model), context.device), context)
    packed = HeadPacking().apply(candidate, context)
    fused = ConvFusion().apply(packed, context)
    towers = (fused.module.head.cls_tower, fused.module.head.reg_tower)
    assert all(isinstance(block[0], FusedConv2dReLU) for tower in towers for block in tower)
    blocks = [m for m in fused.module.modules() if isinstance(m, FusedResidualBlock)]
    assert len(blocks) == 8  # ResNet-18's BasicBlocks
    with torch.no_grad():
        expected = model(photos)
        assert compare_detections(expected, OptimizedModule.from_candidate(fused)(photos)).passed


@cuda
def test_conv2d_relu_on_cuda_matches_the_unfused_arithmetic():
    torch.manual_seed(0)
    cl = torch.channels_last
    for dtype, tolerance in ((torch.float32, 1e-2), (torch.float16, 2e-2)):
        x = torch.randn(4, 64, 30, 40, device="cuda", dtype=dtype).to(memory_format=cl)
        weight = (torch.randn(128, 64, 3, 3, device="cuda", dtype=dtype) / 24).to(memory_format=cl)
        bias = torch.randn(128, device="cuda", dtype=dtype)
        residual = torch.randn(4, 128, 30, 40, device="cuda", dtype=dtype)
        for res in (None, residual):
            args = (x, weight, bias, res, [1, 1], [1, 1], [1, 1], 1)
            out = torch.ops.bladesmith.conv2d_relu(*args)
            torch.testing.assert_close(
                out.double(), reference(*args), rtol=tolerance, atol=tolerance
            )


@cuda
def test_fused_detector_compiles_and_keeps_the_detections(detector):
    from bladesmith.passes.channels_last import ChannelsLast
    from bladesmith.passes.cuda_graph import CudaGraph
    from bladesmith.passes.inductor import Inductor
    from bladesmith.passes.precision import Float16

    plain, fused = detections_through(
        *detector,
        (Float16(), ChannelsLast(), Inductor(), CudaGraph()),
        (Float16(), ChannelsLast(), ConvFusion(), Inductor(), CudaGraph()),
    )
    assert compare_detections(plain, fused, score_atol=1.1e-2).passed
