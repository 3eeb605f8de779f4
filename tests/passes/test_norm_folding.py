"""The norm_folding pass: batch norms folded into the convolutions before them (CPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchvision.models import resnet18, resnet50
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.resnet import Bottleneck

from bladesmith.engine.reference import reference_under_noise
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


class HandWritten(nn.Module):
    """Convolutions and batch norms called from a hand-written forward, in no container
    and no torchvision block; conv3's output is also read past its norm."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8)
        self.conv3, self.bn3 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        z = self.conv3(y)
        return self.bn2(self.conv2(y)) + self.bn3(z) + z


class Untraceable(nn.Module):
    """Data-dependent control flow around a traceable child and a direct pair."""

    def __init__(self):
        super().__init__()
        self.inner = HandWritten()
        self.conv, self.bn = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.inner(x)
        if y.sum() > 0:
            y = y * 2
        return self.bn(self.conv(y))


def folded_keeping_outputs(net: nn.Module) -> nn.Module:
    """``net`` (its norms randomized) through the pass, checked to compute the same."""
    net = randomize_norms(net)
    x = torch.randn(2, 3, 16, 16)
    folded = folded_by_the_pass(net, x)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), net(x), rtol=1e-4, atol=1e-4)
    return folded


def test_folds_pairs_a_hand_written_forward_makes_and_only_those():
    folded = folded_keeping_outputs(HandWritten())
    assert isinstance(folded.bn1, nn.Identity) and isinstance(folded.bn2, nn.Identity)
    assert isinstance(folded.bn3, nn.BatchNorm2d)  # conv3's output is read twice


def test_an_untraceable_forward_is_searched_child_by_child():
    folded = folded_keeping_outputs(Untraceable())
    assert isinstance(folded.inner.bn1, nn.Identity)  # the traceable child: through its graph
    assert isinstance(folded.bn, nn.BatchNorm2d)  # the parent's own calls cannot be seen


def test_folds_every_norm_of_torchvision_resnet50():
    net = randomize_norms(resnet50())
    x = torch.randn(1, 3, 64, 64)
    folded = folded_by_the_pass(net, x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    with torch.no_grad():
        expected = net(x)
        scale = expected.abs().max().item()
        torch.testing.assert_close(folded(x), expected, rtol=1e-3, atol=1e-4 * scale)


def test_a_module_shared_by_two_names_is_not_folded():
    conv, norm = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
    net = randomize_norms(nn.Sequential(nn.Sequential(conv, norm), nn.Sequential(conv)))
    context = context_for((torch.randn(1, 3, 8, 8),))
    reason = NormFolding().skip_reason(Candidate(net, CPU), context)
    assert reason == "the model has no convolution followed by a batch norm"


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
    # As optimize's gate judges it: a fold rounds weights differently, which can swap
    # detections tied at a cut; the model's own runs under rounding noise show which.
    noisy = [run[0] for run in reference_under_noise(model.eval(), [(photos,)])]
    result = compare_detections(adapted, folded, iou_threshold=0.99, min_f1=0.99, noisy=noisy)
    assert result.passed, result.summary()


def test_folds_the_aten_calls_of_torchvision_models_given_as_torch_export_programs():
    from torchvision.models import mobilenet_v3_small

    for build in (resnet18, mobilenet_v3_small):
        net = randomize_norms(build())
        x = torch.randn(2, 3, 64, 64)
        program = torch.export.export(net, (x,)).module()
        norm_op = torch.ops.aten.batch_norm.default
        norms = sum(node.target is norm_op for node in program.graph.nodes)
        assert norms == sum(isinstance(m, nn.BatchNorm2d) for m in net.modules())
        assert NormFolding().skip_reason(Candidate(program, CPU), context_for((x,))) is None
        folded = folded_by_the_pass(program, x)
        targets = [node.target for node in folded.graph.nodes]
        assert norm_op not in targets, build.__name__
        with torch.no_grad():
            expected = net(x)
            scale = expected.abs().max().item()
            torch.testing.assert_close(folded(x), expected, rtol=1e-4, atol=1e-5 * scale)
        # The folded weights replace the old ones, which are gone, not kept beside them.
        buffers = [name for name, _ in folded.named_buffers()]
        assert not any(name.endswith(("running_mean", "running_var")) for name in buffers)
        assert sum(p.numel() for p in folded.parameters()) < sum(
            p.numel() for p in program.parameters()
        )
        torch.export.export(folded, (x,))  # still a program torch.export takes


def test_an_exported_norm_with_batch_statistics_is_left():
    net = randomize_norms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    x = torch.randn(1, 3, 8, 8)
    training = torch.export.export(net.train(), (x,)).module()
    context = context_for((x,))
    reason = NormFolding().skip_reason(Candidate(training, CPU), context)
    assert reason == "the model has no convolution followed by a batch norm"
