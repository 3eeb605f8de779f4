"""The channel_padding pass: padded weights, the same outputs, shared layers, detectors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from bladesmith.artifact import OptimizedModule
from bladesmith.ops.build import unavailable
from bladesmith.passes import Candidate
from bladesmith.passes.channel_padding import ChannelPadded, ChannelPadding
from bladesmith.passes.conv_fusion import ConvFusion, FusedConv2dReLU
from bladesmith.passes.fixed_shape import FixedShape
from bladesmith.passes.head_packing import HeadPacking
from bladesmith.verify import compare_detections
from engine_testing import context_for, cuda, detections_through

CPU = torch.device("cpu")


class TwoHeads(nn.Module):
    """An image stem, and one output layer (13 channels) that two containers share."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        shared = nn.Conv2d(8, 13, 3, padding=1)
        self.first = nn.Sequential(shared)
        self.second = nn.ModuleList([shared])
        self.even = nn.Conv2d(8, 16, 1)

    def forward(self, x):
        x = self.stem(x)
        return self.first(x), self.second[0](x), self.even(x)


def test_pads_weights_keeps_outputs_and_replaces_a_shared_layer_once():
    model = TwoHeads().eval()
    x = torch.randn(2, 3, 9, 11)
    context = context_for((x,))
    result = ChannelPadding().apply(Candidate(model, CPU), context)
    net = result.module
    stem, first, second = net.stem[0], net.first[0], net.second[0]
    assert isinstance(stem, ChannelPadded) and stem.conv.weight.shape == (8, 4, 3, 3)
    assert first is second and first.conv.weight.shape == (16, 8, 3, 3)
    assert type(net.even) is nn.Conv2d  # 16 outputs: nothing to pad
    assert type(model.stem[0]) is nn.Conv2d and model.first[0].weight.shape[0] == 13
    with torch.no_grad():
        for got, expected in zip(net(x), model(x)):
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert context.notes[-1] == ("channel_padding: stem.0: 3->8 as 4->8; first.0: 8->13 as 8->16")


@pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")
def test_pads_a_fused_stem_and_leaves_residual_blocks_alone():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), BasicBlock(8, 8)
    ).eval()
    x = torch.randn(1, 3, 10, 10)
    context = context_for((x,))
    fused = ConvFusion().apply(Candidate(model, CPU), context)
    padded = ChannelPadding().apply(fused, context)
    assert isinstance(padded.module[0], ChannelPadded)
    assert isinstance(padded.module[0].conv, FusedConv2dReLU)
    assert padded.module[0].conv.weight.shape == (8, 4, 3, 3)
    assert context.notes[-1] == "channel_padding: 0: 3->8 as 4->8"
    with torch.no_grad():
        torch.testing.assert_close(padded.module(x), model(x), rtol=1e-5, atol=1e-5)


def test_skips_models_whose_channels_need_no_padding():
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 16, 1))
    reason = ChannelPadding().skip_reason(Candidate(model, CPU), context_for((None,)))
    assert reason == "every convolution has channel counts cuDNN takes as they are"


@pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")
def test_detector_with_a_packed_head_keeps_its_detections(detector):
    model, photos = detector
    context = context_for((photos,))
    candidate = FixedShape().apply(Candidate(copy.deepcopy(model), CPU), context)
    candidate = ChannelPadding().apply(HeadPacking().apply(candidate, context), context)
    # ResNet-18's stem; 3 classes x 9 anchors and 4 x 9 box deltas out.
    assert context.notes[-1] == (
        "channel_padding: backbone.body.conv1: 3->64 as 4->64; "
        "head.cls_logits: 256->27 as 256->32; head.bbox_reg: 256->36 as 256->40"
    )
    with torch.no_grad():
        expected = model(photos)
        assert compare_detections(
            expected, OptimizedModule.from_candidate(candidate)(photos)
        ).passed


@cuda
def test_padded_and_fused_detector_compiles_and_keeps_the_detections(detector):
    from bladesmith.passes.channels_last import ChannelsLast
    from bladesmith.passes.cuda_graph import CudaGraph
    from bladesmith.passes.inductor import Inductor
    from bladesmith.passes.precision import Float16

    plain, padded = detections_through(
        *detector,
        (Float16(), ChannelsLast(), Inductor(), CudaGraph()),
        (Float16(), ChannelsLast(), ConvFusion(), ChannelPadding(), Inductor(), CudaGraph()),
    )
    assert compare_detections(plain, padded, score_atol=1.1e-2).passed
