"""The norm_folding pass: batch norms folded into the convolutions before them (CPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchvision.models import resnet18
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.resnet import Bottleneck

from bladesmith.passes import Candidate
from bladesmith.passes.norm_folding import NormFolding
from bladesmith.verify import compare_detections
from engine_testing import context_for, detections_through, randomize_norms, tiny_detector

CPU = torch.device("cpu")


def folded_by_the_pass(net: nn.Module, x: torch.Tensor) -> nn.Module:
    context = context_for((x,))
    return NormFolding().apply(Candidate(net, CPU), context).module


def test_folds_resnet_blocks_and_ordered_containers_and_keeps_the_outputs():
    trunk = resnet18()
    # The stem and the first stage in the container torchvision's detectors use.
    net = randomize_norms(
        IntermediateLayerGetter(
            nn.Sequential(
                trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool, trunk.layer1, trunk.layer2
            ),
            {"5": "out"},
        )
    )
    before = copy.deepcopy(net.state_dict())
    x = torch.randn(2, 3, 64, 80)
    folded = folded_by_the_pass(net, x)
    with torch.no_grad():
        expected, result = net(x)["out"], folded(x)["out"]
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(c.bias is not None for c in convs)
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    for name, value in net.state_dict().items():  # the candidate's module is untouched
        assert torch.equal(value, before[name]), name


def test_folds_bottlenecks_with_their_shortcut():
    shortcut = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32))
    block = randomize_norms(Bottleneck(16, 8, downsample=shortcut))
    x = torch.randn(1, 16, 12, 12)
    folded = folded_by_the_pass(block, x)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), block(x), rtol=1e-4, atol=1e-4)
    assert sum(isinstance(m, nn.Identity) for m in folded.modules()) == 4


def test_leaves_norms_it_cannot_fold_and_skips_models_without_any():
    training_norm = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))  # batch statistics
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    context = context_for((torch.randn(1, 3, 8, 8),))
    for net in (training_norm, plain):
        reason = NormFolding().skip_reason(Candidate(net, CPU), context)
        assert reason == "the model has no convolution followed by a batch norm"
    assert NormFolding.rewrites_modules  # the engine skips it for TorchScript modules


def test_detector_keeps_its_detections():
    model, photos = tiny_detector()
    # The same norms in any test order: some draws leave near ties that NMS resolves
    # either way after any rounding change, which this strict comparison counts.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        randomize_norms(model)
    adapted, folded = detections_through(model, photos, [], [NormFolding()], device="cpu")
    result = compare_detections(adapted, folded, iou_threshold=0.99, min_f1=0.99)
    assert result.passed, result.summary()
