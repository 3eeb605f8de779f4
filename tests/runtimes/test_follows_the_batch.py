"""follows_the_batch: a runner that answers as its module at other batches is told from
one whose graph kept its example's batch, in float32 and in bfloat16 alike."""

import torch
from torch import nn

from bladesmith.passes.precision import AutocastFloats
from bladesmith.runtimes.built_for import follows_the_batch
from bladesmith.runtimes.torchscript import freeze, quiet_torchscript


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3),
        nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    for norm in (m for m in net.modules() if isinstance(m, nn.BatchNorm2d)):
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    return net.eval()


def traced(net: nn.Module, x: torch.Tensor, dtype: torch.dtype):
    """As the torchscript pass builds it: the frozen trace under the same autocast."""
    with quiet_torchscript():
        runner = AutocastFloats(freeze(net, (x,)), dtype, torch.float32)
        with torch.no_grad():
            runner(x)
    return runner


def test_a_bfloat16_trace_follows_the_batch_though_it_rounds_past_float32s_bound():
    net, x = conv_net(), torch.randn(2, 3, 32, 32)
    module = AutocastFloats(net, torch.bfloat16, torch.float32)
    runner = traced(net, x, torch.bfloat16)
    with torch.no_grad():
        rounding = (runner(x) - module(x)).abs().max() / module(x).abs().max()
    assert rounding > 1e-3  # past the bound a float32 comparison allows
    assert follows_the_batch(runner, module, (x,))


class KeepsItsBatch(nn.Module):
    """Traced at batch 2, the trace keeps the branch batch 2 takes."""

    def __init__(self):
        super().__init__()
        self.net = conv_net()

    def forward(self, x):
        y = self.net(x)
        return y * 2 if x.shape[0] == 2 else y


def test_a_trace_that_kept_its_batch_is_told_apart_in_bfloat16_too():
    model, x = KeepsItsBatch().eval(), torch.randn(2, 3, 32, 32)
    for dtype in (torch.float32, torch.bfloat16):
        module = AutocastFloats(model, dtype, torch.float32)
        assert not follows_the_batch(traced(model, x, dtype), module, (x,)), dtype
