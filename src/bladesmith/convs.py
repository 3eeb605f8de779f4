"""What rewrites of convolution layers check before they touch one."""

from __future__ import annotations

import torch
from torch import nn


def is_same_size_3x3(module: nn.Module) -> bool:
    """A plain nn.Conv2d, 3x3, stride 1, zero padding 1, no dilation or groups: its output
    has its input's size, and every output sees exactly the 3x3 window around it."""
    return (
        type(module) is nn.Conv2d
        and module.kernel_size == (3, 3)
        and module.stride == (1, 1)
        and module.padding == (1, 1)
        and module.dilation == (1, 1)
        and module.groups == 1
        and module.padding_mode == "zeros"
    )


def is_foldable_norm(module: nn.Module) -> bool:
    """A batch norm with fixed statistics (eval mode, or torchvision's frozen one): an
    affine map per channel, which a convolution before it can absorb."""
    from torchvision.ops import FrozenBatchNorm2d

    if isinstance(module, nn.BatchNorm2d):
        return not module.training and module.track_running_stats
    return isinstance(module, FrozenBatchNorm2d)


def runs_in_order(parent: nn.Module) -> bool:
    """A container whose forward runs its children one after the other."""
    from torchvision.models._utils import IntermediateLayerGetter

    return isinstance(parent, (nn.Sequential, IntermediateLayerGetter))


def norm_after(parent: nn.Module, children: list[tuple[str, nn.Module]], position: int):
    """The name of the foldable batch norm that ``parent``'s forward applies directly to
    the output of ``children[position]``, where the structure says so: the next child of
    a container that runs its children in order, or ``bnN`` after ``convN`` in
    torchvision's ResNet blocks; else None."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    if runs_in_order(parent):
        return norm_and_relu_after(children, position)[0]
    name = children[position][0]
    if isinstance(parent, (BasicBlock, Bottleneck)) and name.startswith("conv"):
        norm = name.replace("conv", "bn")
        return norm if is_foldable_norm(getattr(parent, norm, None)) else None
    return None


def norm_and_relu_after(
    children: list[tuple[str, nn.Module]], position: int
) -> tuple[str | None, str | None]:
    """In a container that runs ``children`` (name, module) in order: the names of the
    foldable batch norm and of the ReLU that directly follow ``children[position]``, the
    norm first; each None where there is none."""
    following = children[position + 1 : position + 3]
    norm = following[0][0] if following and is_foldable_norm(following[0][1]) else None
    after = following[1:] if norm else following
    relu = after[0][0] if after and type(after[0][1]) is nn.ReLU else None
    return norm, relu


@torch.no_grad()
def fold_norm(conv: nn.Conv2d, norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of ``conv`` followed by ``norm`` (a foldable one, or None), in
    the convolution's dtype; the arithmetic is float32 whatever that dtype is."""
    weight = conv.weight.detach()
    bias = conv.bias.detach() if conv.bias is not None else None
    if norm is None:
        return weight, bias if bias is not None else weight.new_zeros(conv.out_channels)
    return fold_affine(
        weight, bias, norm.weight, norm.bias, norm.running_mean, norm.running_var, norm.eps
    )


def fold_affine(weight, bias, norm_weight, norm_bias, mean, var, eps: float):
    """A convolution's (weight, bias) with the batch norm ``(x - mean) / sqrt(var + eps) *
    norm_weight + norm_bias`` after it folded in, in the weight's dtype (the arithmetic is
    float32). ``bias``, ``norm_weight`` and ``norm_bias`` may be None (absent)."""
    dtype = weight.dtype
    root = torch.sqrt(var.detach().float() + eps)
    scale = (norm_weight.detach().float() if norm_weight is not None else 1.0) / root
    shifted = -mean.detach().float() if bias is None else bias.detach().float() - mean.float()
    folded_bias = shifted * scale
    if norm_bias is not None:
        folded_bias = folded_bias + norm_bias.detach().float()
    folded_weight = weight.detach().float() * scale.view(-1, *[1] * (weight.dim() - 1))
    return folded_weight.to(dtype), folded_bias.to(dtype)
