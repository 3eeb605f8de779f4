"""winograd: 3x3 stride-1 convolutions as Winograd F(4x4, 3x3), where faster (CPU).

Three quarters of a RetinaNet's FLOPs are 3x3 stride-1 convolutions, and oneDNN runs
them near this CPU's peak: only fewer multiplications make them faster. Winograd
F(4x4, 3x3) computes a 4x4 output tile with 36 multiplications per channel pair instead
of 144 (float32 error about 1e-5 relative). The operator
``torch.ops.bladesmith.winograd_conv3x3`` (``ops/csrc/cpu/winograd_kernel.cpp``)
transforms the input and output tiles itself and leaves the 36 products to oneDNN, as one
grouped 1x1 convolution; it transforms each kernel once per process, and fuses the bias
and a following ReLU.

The pass times oneDNN against the operator on each convolution's real input sizes (from
the test data) and switches only the (convolution, input size) pairs that the operator
runs faster (``MIN_GAIN``, ``MIN_SAVING_MS``): on the smallest levels too few tiles keep
oneDNN's grouped convolution busy. The engine then times the whole model. Batch norms
after a switched convolution are folded into it. TorchScript traces and freezes the
operator; when compiling (Inductor, ``torch.export``) or exporting to ONNX the module is a
plain convolution again.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.convs import (
    fold_norm,
    is_same_size_3x3,
    norm_after,
    norm_and_relu_after,
    runs_in_order,
)
from bladesmith.ops import exporting
from bladesmith.ops.build import unavailable
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.layer_inputs import watch_inputs
from bladesmith.passes.registry import Context, Pass, PassSkipped

# The operator must run a convolution alone this much faster than oneDNN, and save this
# much per call, to be used: timings on random data alone move by about 10%.
MIN_GAIN = 1.15
MIN_SAVING_MS = 0.1
_ROUNDS = 5


class WinogradConv2d(nn.Module):
    """A 3x3 stride-1 padding-1 convolution (+ ReLU) that runs Winograd F(4x4, 3x3) on the
    input sizes in ``sizes``, and ``F.conv2d`` on other sizes and whenever it is compiled
    or exported (those see a plain convolution)."""

    def __init__(self, weight, bias, relu: bool, sizes):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", bias.detach().clone())
        self.relu = relu
        self.sizes = frozenset(sizes)

    def forward(self, x):
        if not exporting() and x.dtype == torch.float32:
            # TorchScript's tracer makes shapes tensors: int() reads the value it records.
            if (int(x.shape[-2]), int(x.shape[-1])) in self.sizes:
                return torch.ops.bladesmith.winograd_conv3x3(x, self.weight, self.bias, self.relu)
        y = F.conv2d(x, self.weight, self.bias, 1, 1)
        return F.relu(y) if self.relu else y

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{h}x{w}" for h, w in sorted(self.sizes))
        channels = f"{self.weight.shape[1]}, {self.weight.shape[0]}"
        return f"{channels}, relu={self.relu}, winograd at {sizes}"


def eligible(module: nn.Module) -> bool:
    """A float32 3x3 convolution, stride 1, padding 1, no dilation or groups."""
    return is_same_size_3x3(module) and module.weight.dtype == torch.float32


class Winograd(Pass):
    """3x3 stride-1 convolutions as Winograd F(4x4, 3x3), where timed faster (CPU)."""

    name = "winograd"
    rewrites_modules = True
    devices = ("cpu",)
    # TorchScript traces the operator (.pt keeps it); an export or a compile sees the
    # plain convolutions again.
    lost_in = {
        ".onnx": "an ONNX export holds the plain convolutions, which oneDNN runs",
        ".pt2": "torch.export holds the plain convolutions",
        ".ov": "OpenVINO converts the plain convolutions",
    }

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if candidate.dtype != torch.float32:
            return "the Winograd operator computes in float32 only"
        if not any(eligible(m) for m in candidate.module.modules()):
            return "the model has no 3x3 stride-1 convolutions"
        return unavailable()

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        with context.step("timing oneDNN against Winograd per convolution"):
            sizes = _input_sizes(module, [candidate.runner_args(a) for a in context.test_args])
            timings = {key: _time(*key) for key in {_key(c, s) for c, ss in sizes for s in ss}}
        chosen = {
            conv: {s for s in conv_sizes if _wins(timings[_key(conv, s)])}
            for conv, conv_sizes in sizes
        }
        switched = _replace(module, {conv: s for conv, s in chosen.items() if s})
        if not switched:
            raise PassSkipped(f"oneDNN is faster on every 3x3 convolution: {_summary(timings)}")
        context.notes.append(
            f"winograd: {len(switched)} of {len(sizes)} 3x3 stride-1 convolutions run "
            f"Winograd at some input size ({', '.join(switched)}); per call, "
            f"oneDNN -> Winograd: {_summary(timings)}"
        )
        return candidate.with_module(module, self.name)


def _input_sizes(module: nn.Module, test_args: list[tuple]) -> list[tuple[nn.Conv2d, list]]:
    """Each eligible convolution with the input shapes it gets on the test data."""
    seen: dict[nn.Conv2d, list] = {}

    def record(conv, args):
        shape = tuple(args[0].shape)
        if args[0].dtype == torch.float32 and shape not in seen[conv]:
            seen[conv].append(shape)

    seen.update((conv, []) for conv in module.modules() if eligible(conv))
    watch_inputs(module, list(seen), test_args, record)
    return [(conv, shapes) for conv, shapes in seen.items() if shapes]


def _key(conv: nn.Conv2d, shape: tuple) -> tuple:
    return (conv.out_channels, *shape)


def _time(out_channels: int, batch: int, channels: int, height: int, width: int):
    """Median ms per call of oneDNN and of the operator on random channels_last data of
    this shape (what the channels_last pass makes of the model): each runs three times in
    a row, of which the last two are timed, the two in turn so that a burst of load
    elsewhere hits both."""
    x = torch.randn(batch, channels, height, width).to(memory_format=torch.channels_last)
    weight = torch.randn(out_channels, channels, 3, 3) * (channels * 9) ** -0.5
    bias = torch.zeros(out_channels)
    runs = {
        "onednn": lambda: F.conv2d(x, weight, bias, 1, 1),
        "winograd": lambda: torch.ops.bladesmith.winograd_conv3x3(x, weight, bias, False),
    }
    times = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(_ROUNDS):
            for name, run in runs.items():
                for call in range(3):
                    start = time.perf_counter()
                    run()
                    if call >= 1:
                        times[name].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["onednn"]), statistics.median(times["winograd"])


def _wins(timing: tuple[float, float]) -> bool:
    onednn, winograd = timing
    return winograd * MIN_GAIN <= onednn and onednn - winograd >= MIN_SAVING_MS


def _summary(timings: dict) -> str:
    return ", ".join(
        f"{channels}->{out} at {h}x{w} {onednn:.2f} -> {winograd:.2f} ms"
        + ("" if _wins((onednn, winograd)) else " (kept oneDNN)")
        for (out, _, channels, h, w), (onednn, winograd) in sorted(
            timings.items(), key=lambda item: -item[1][0]
        )
    )


def _replace(module: nn.Module, chosen: dict[nn.Conv2d, set]) -> list[str]:
    """Swap each chosen convolution for a WinogradConv2d; returns the names swapped.

    What follows the convolution is folded into it where the structure says what
    follows (``norm_after``): a batch norm, and in a container that runs its children in
    order, a ReLU after it."""
    swapped = []
    for parent_name, parent in list(module.named_modules()):
        children = list(parent.named_children())
        for position, (name, conv) in enumerate(children):
            if conv not in chosen:
                continue
            norm = norm_after(parent, children, position)
            relu = norm_and_relu_after(children, position)[1] if runs_in_order(parent) else None
            weight, bias = fold_norm(conv, getattr(parent, norm) if norm else None)
            sizes = {shape[-2:] for shape in chosen[conv]}
            setattr(parent, name, WinogradConv2d(weight, bias, relu is not None, sizes))
            for other in (norm, relu):
                if other:
                    setattr(parent, other, nn.Identity())
            swapped.append(f"{parent_name}.{name}".lstrip("."))
    return swapped
