"""The winograd pass: the Winograd F(4x4, 3x3) operator, the rewrite, and what composes with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import BasicBlock

from bladesmith.ops.build import unavailable
from bladesmith.passes import Candidate, PassSkipped, registry, winograd
from bladesmith.passes.fixed_shape import FixedShape
from bladesmith.passes.onnxruntime import OnnxRuntime
from bladesmith.passes.torchscript import TorchScriptFreeze
from bladesmith.passes.winograd import Winograd, WinogradConv2d
from bladesmith.verify import compare_detections
from engine_testing import context_for, randomize_norms

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")
CPU = torch.device("cpu")


@pytest.fixture
def winograd_wins(monkeypatch):
    """Make the operator win the timing on the input sizes given (every size by default), so
    that what the pass switches does not depend on the machine's load."""

    def set_winning(sizes=None):
        def timing(out_channels, batch, channels, height, width):
            return (2.0, 1.0) if sizes is None or (height, width) in sizes else (1.0, 2.0)

        monkeypatch.setattr(winograd, "_time", timing)

    set_winning()
    return set_winning


def reference_conv(x, weight, bias, relu):
    y = F.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    return y.relu() if relu else y


@pytest.mark.parametrize(
    ("shape", "out_channels", "relu", "channels_last"),
    [
        ((1, 16, 12, 20), 8, False, True),
        ((2, 8, 7, 5), 24, True, False),  # sizes that are not multiples of the 4x4 tile
        ((1, 3, 1, 1), 4, False, False),
        ((1, 80, 9, 6), 70, True, True),  # more channels than one block of the kernel
    ],
)
def test_conv3x3_matches_a_float64_convolution(shape, out_channels, relu, channels_last):
    torch.manual_seed(0)
    x = torch.randn(shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    weight, bias = torch.randn(out_channels, shape[1], 3, 3), torch.randn(out_channels)
    out = torch.ops.bladesmith.winograd_conv3x3(x, weight, bias, relu)
    expected = reference_conv(x, weight, bias, relu)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    error = (out.double() - expected).abs().max() / expected.abs().max()
    assert error < 1e-5  # Winograd F(4x4, 3x3) in float32: a few 1e-6 here


def test_kernel_is_transformed_again_after_a_change_in_place():
    torch.manual_seed(0)
    x, bias, weight = torch.randn(1, 8, 10, 12), torch.zeros(8), torch.randn(8, 8, 3, 3)
    torch.ops.bladesmith.winograd_conv3x3(x, weight, bias, False)
    weight.mul_(-1)  # the transform made on the first call is stale now
    out = torch.ops.bladesmith.winograd_conv3x3(x, weight, bias, False)
    torch.testing.assert_close(out, F.conv2d(x, weight, bias, padding=1), rtol=1e-4, atol=1e-4)
    other = torch.randn(8, 8, 3, 3)  # a new weight, maybe at a freed one's address
    out = torch.ops.bladesmith.winograd_conv3x3(x, other, bias, False)
    torch.testing.assert_close(out, F.conv2d(x, other, bias, padding=1), rtol=1e-4, atol=1e-4)


def test_conv3x3_refuses_other_dtypes_and_shapes():
    x, weight = torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3)
    with pytest.raises(TypeError, match="float32"):
        torch.ops.bladesmith.winograd_conv3x3(x.double(), weight, torch.zeros(4), False)
    with pytest.raises(ValueError, match=r"expected a weight \[K, 5, 3, 3\]"):
        torch.ops.bladesmith.winograd_conv3x3(
            torch.randn(1, 5, 5, 5), weight, torch.zeros(4), False
        )
    with pytest.raises(ValueError, match="expected 4 bias values, got 3"):
        torch.ops.bladesmith.winograd_conv3x3(x, weight, torch.zeros(3), False)


def conv_bn_relu_net() -> nn.Module:
    """Sequential conv -> batch norm -> ReLU, a torchvision BasicBlock (conv1 -> bn1),
    and a convolution the pass must leave alone (stride 2)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        BasicBlock(8, 8),
        nn.Conv2d(8, 4, 3, stride=2, padding=1),
    )
    return randomize_norms(net)


def test_apply_folds_batch_norms_and_relu_and_keeps_the_outputs(winograd_wins):
    model = conv_bn_relu_net()
    x = torch.randn(2, 3, 16, 20)
    context = context_for((x,))
    result = Winograd().apply(Candidate(module=model, device=CPU), context)
    net = result.module
    assert isinstance(net[0], WinogradConv2d) and net[0].relu
    assert isinstance(net[1], nn.Identity) and isinstance(net[2], nn.Identity)
    block = net[3]
    assert isinstance(block.conv1, WinogradConv2d) and not block.conv1.relu
    assert isinstance(block.bn1, nn.Identity) and isinstance(block.bn2, nn.Identity)
    assert type(net[4]) is nn.Conv2d  # stride 2: not eligible
    assert net[0].sizes == {(16, 20)}
    assert result.applied == ("winograd",)
    assert isinstance(model[1], nn.BatchNorm2d)  # the candidate given is untouched
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x), rtol=1e-4, atol=1e-4)
    assert "3 of 3 3x3 stride-1 convolutions" in context.notes[-1]
    assert "(0, 3.conv1, 3.conv2)" in context.notes[-1]


def test_only_the_sizes_where_the_operator_wins_are_switched(winograd_wins):
    winograd_wins({(8, 10)})
    conv = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)).eval()
    small, large = torch.randn(1, 4, 8, 10), torch.randn(1, 4, 16, 20)
    context = context_for((small,))
    context.test_args.append((large,))
    result = Winograd().apply(Candidate(module=conv, device=CPU), context)
    assert result.module[0].sizes == {(8, 10)}
    with torch.no_grad():
        for x in (small, large):
            torch.testing.assert_close(result.module(x), conv(x), rtol=1e-4, atol=1e-4)
    winograd_wins(set())
    with pytest.raises(PassSkipped, match="oneDNN is faster on every 3x3 convolution"):
        Winograd().apply(Candidate(module=conv, device=CPU), context_for((small,)))


def test_skip_reasons():
    pass_ = Winograd()
    linear = Candidate(module=nn.Linear(2, 2), device=CPU)
    assert "no 3x3 stride-1 convolutions" in pass_.skip_reason(linear, context_for(()))
    assert pass_.rewrites_modules  # the engine skips it for TorchScript modules
    half = Candidate(module=conv_bn_relu_net(), device=CPU, dtype=torch.bfloat16)
    assert "float32" in pass_.skip_reason(half, context_for(()))
    plain = Candidate(module=conv_bn_relu_net(), device=CPU)
    assert pass_.skip_reason(plain, context_for(())) is None


def test_registered_between_precision_and_memory_format():
    names = registry.names()
    assert names.index("bf16") < names.index("winograd") < names.index("channels_last")


def test_torchscript_runs_the_operator_and_exporters_see_a_convolution(winograd_wins):
    model = conv_bn_relu_net()
    x = torch.randn(1, 3, 16, 20)
    context = context_for((x,))
    switched = Winograd().apply(Candidate(module=model, device=CPU), context)
    scripted = TorchScriptFreeze().apply(switched, context)
    assert "bladesmith::winograd_conv3x3" in str(scripted.runner.graph)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(scripted(x), expected, rtol=1e-4, atol=1e-4)
        exported = torch.export.export(switched.module, (x,), strict=False)
    assert "winograd_conv3x3" not in str(exported.graph)
    assert "conv2d" in str(exported.graph)
    session = OnnxRuntime().apply(switched, context)
    torch.testing.assert_close(session(x), expected, rtol=1e-4, atol=1e-4)


def test_detector_with_winograd_then_torchscript_keeps_its_detections(winograd_wins):
    from bladesmith.families.base import DetectionsAsList
    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    size = (128, 160)
    model = build_retinanet(size, backbone="resnet18", num_classes=3)
    photos = list(sample_images(1, size))
    context = context_for((photos,))
    adapted = FixedShape().apply(Candidate(module=model, device=CPU), context)
    switched = Winograd().apply(adapted, context)
    scripted = TorchScriptFreeze().apply(switched, context)
    head = switched.module.head.classification_head
    assert isinstance(head.conv[0][0], WinogradConv2d) and head.conv[0][0].relu
    assert len(head.conv[0][0].sizes) == len(switched.module.level_sizes)  # every level
    assert isinstance(switched.module.backbone.body.layer1[0].bn2, nn.Identity)
    with torch.no_grad():
        expected = model(photos)
        for candidate in (switched, scripted):
            detections = DetectionsAsList(candidate)(photos)
            comparison = compare_detections(expected, detections)
            assert comparison.passed and comparison.strict_f1 == 1.0, comparison.summary()
