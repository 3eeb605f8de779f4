"""conv_fusion: convolution + bias (+ shortcut) + ReLU as one cuDNN call (GPU).

Inductor hands cuDNN each convolution without its bias, then adds bias, shortcut and ReLU
in a kernel of its own, which reads and writes the whole activation once more: at batch
32 such kernels took 2.9 of RetinaNet's 14 ms on the H200. The operator
``torch.ops.bladesmith.conv2d_relu`` (``ops/csrc/conv_relu.cpp``) is cuDNN's fused
convolution-bias-add-ReLU, which Inductor calls as it is.

The pass rewrites, in containers that run their children in order, a convolution
followed by a ReLU (a batch norm between is folded into the weights), and torchvision's
ResNet blocks whole, the shortcut added inside the last convolution's call.
Convolutions without a ReLU after them stay plain. When exported to ONNX the modules
are plain convolutions again.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.convs import (
    fold_norm,
    is_foldable_norm,
    norm_and_relu_after,
    runs_in_order,
)
from bladesmith.ops.build import unavailable
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class FusedConv2dReLU(nn.Module):
    """``relu(conv(x) + bias [+ residual])`` in one call; a batch norm folded in."""

    def __init__(self, conv: nn.Conv2d, norm: nn.Module | None = None):
        super().__init__()
        weight, bias = fold_norm(conv, norm)
        # The layout the operator convolves in, so no call has to convert the weight.
        self.register_buffer("weight", weight.clone(memory_format=torch.channels_last))
        self.register_buffer("bias", bias.clone())
        self.stride = list(conv.stride)
        self.padding = list(conv.padding)
        self.dilation = list(conv.dilation)
        self.groups = conv.groups

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            y = F.conv2d(
                x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
            )
            return F.relu(y if residual is None else y + residual)
        return torch.ops.bladesmith.conv2d_relu(
            x,
            self.weight,
            self.bias,
            residual,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
        )

    def extra_repr(self) -> str:
        out_channels, in_channels, *kernel = self.weight.shape
        stride = tuple(self.stride)
        return f"{in_channels}, {out_channels}, kernel_size={tuple(kernel)}, stride={stride}"


class FusedResidualBlock(nn.Module):
    """A torchvision ResNet block (BasicBlock or Bottleneck): each convolution with its
    batch norm and ReLU one call, the last adding the shortcut before its ReLU."""

    def __init__(self, block: nn.Module):
        super().__init__()
        count = _conv_count(block)
        self.convs = nn.ModuleList(
            FusedConv2dReLU(getattr(block, f"conv{i}"), getattr(block, f"bn{i}"))
            for i in range(1, count + 1)
        )
        self.downsample = block.downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        for conv in self.convs[:-1]:
            x = conv(x)
        return self.convs[-1](x, shortcut)


def _conv_count(block: nn.Module) -> int:
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return {BasicBlock: 2, Bottleneck: 3}.get(type(block), 0)


def eligible(conv: nn.Module) -> bool:
    """A plain 2-D convolution with zero padding given as sizes (cuDNN's fused call takes
    those, in any dtype cuDNN convolves)."""
    return (
        type(conv) is nn.Conv2d
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
        and conv.weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


def _fusable_block(block: nn.Module) -> bool:
    count = _conv_count(block)
    return count > 0 and all(
        eligible(getattr(block, f"conv{i}")) and is_foldable_norm(getattr(block, f"bn{i}"))
        for i in range(1, count + 1)
    )


def _conv_relu_runs(parent: nn.Module) -> list[tuple[str, str | None, str]]:
    """(convolution, batch norm or None, ReLU): the children names of each convolution
    that a ReLU follows, directly or after a foldable batch norm, in ``parent``."""
    if not runs_in_order(parent):
        return []
    children = list(parent.named_children())
    runs = []
    for position, (name, conv) in enumerate(children):
        if eligible(conv):
            norm, relu = norm_and_relu_after(children, position)
            if relu:
                runs.append((name, norm, relu))
    return runs


def fuse(module: nn.Module) -> list[str]:
    """Rewrite ``module`` in place; returns the names of what was fused."""
    fused = []
    for parent_name, parent in list(module.named_modules()):
        for name, block in list(parent.named_children()):
            if _fusable_block(block):
                setattr(parent, name, FusedResidualBlock(block))
                fused.append(f"{parent_name}.{name}".lstrip("."))
    for parent_name, parent in list(module.named_modules()):
        for conv, norm, relu in _conv_relu_runs(parent):
            setattr(
                parent,
                conv,
                FusedConv2dReLU(
                    getattr(parent, conv), getattr(parent, norm, None) if norm else None
                ),
            )
            for other in (norm, relu):
                if other:
                    setattr(parent, other, nn.Identity())
            fused.append(f"{parent_name}.{conv}".lstrip("."))
    return fused


class ConvFusion(Pass):
    """Convolution + bias (+ shortcut) + ReLU as one cuDNN call, batch norms folded in."""

    name = "conv_fusion"
    rewrites_modules = True
    devices = ("cuda",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available"
        module = candidate.module
        if not any(_fusable_block(m) or _conv_relu_runs(m) for m in module.modules()):
            return "the model has no convolution followed by a ReLU"
        return unavailable()

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        fused = fuse(module)
        context.notes.append(
            f"conv_fusion: {len(fused)} convolution + ReLU sites run as one cuDNN call each "
            f"({', '.join(fused)})"
        )
        return candidate.with_module(module, self.name)
