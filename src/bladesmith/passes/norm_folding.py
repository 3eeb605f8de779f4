"""norm_folding: batch norms folded into the convolutions before them, whose weights are
then kept channels_last (CPU).

In eval mode a batch norm is an affine map per channel, which the convolution before it
absorbs into its weights and bias; on the GPU Inductor's freezing does that, on the CPU
nothing else does (ResNet-50 keeps 40 of them after the winograd pass, about 10 ms a
call at 480x640 on two cores). The folded convolutions' weights are stored channels_last,
so the backbone runs channels_last from the stem on: oneDNN then reorders nothing, and
the stem's max pooling, 10 ms in NCHW, takes 1 ms.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from bladesmith.models.convs import fold_norm, norm_after
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class NormFolding(Pass):
    """Batch norms folded into the convolutions before them, weights channels_last (CPU)."""

    name = "norm_folding"
    rewrites_modules = True
    devices = ("cpu",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if not _pairs(candidate.module):
            return "the model has no convolution followed by a batch norm"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        pairs = _pairs(module)
        for parent, conv_name, norm_name in pairs:
            conv = getattr(parent, conv_name)
            setattr(parent, conv_name, folded(conv, getattr(parent, norm_name)))
            setattr(parent, norm_name, nn.Identity())
        context.notes.append(f"norm_folding: {len(pairs)} batch norms folded")
        return candidate.with_module(module, self.name)


def _pairs(module: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, convolution's name, batch norm's name) of each plain convolution that a
    foldable batch norm directly follows."""
    pairs = []
    for parent in module.modules():
        children = list(parent.named_children())
        for position, (name, conv) in enumerate(children):
            if type(conv) is nn.Conv2d:
                norm = norm_after(parent, children, position)
                if norm is not None:
                    pairs.append((parent, name, norm))
    return pairs


def folded(conv: nn.Conv2d, norm: nn.Module) -> nn.Conv2d:
    """A copy of ``conv`` with ``norm`` folded in, its weight channels_last."""
    weight, bias = fold_norm(conv, norm)
    result = copy.deepcopy(conv)
    result.weight = nn.Parameter(weight.contiguous(memory_format=torch.channels_last), False)
    result.bias = nn.Parameter(bias, False)
    return result
