"""``nn.MultiheadAttention``'s self-attention with its projections as Linear layers called
as modules, so that a pass that rewrites Linear layers (fp8) reaches them: the module
reads its ``in_proj_weight`` and ``out_proj.weight`` itself, which a module swap cannot
touch. The same arithmetic, in the same dtype: one product for the queries, keys and
values, ``scaled_dot_product_attention``, one product out. Any other call (weights asked
for, a mask, cross-attention, an unbatched input) runs the original module."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def projectable(attention: nn.Module) -> bool:
    """Whether ``attention`` is an ``nn.MultiheadAttention`` whose self-attention this
    module computes: one packed input projection, no extra key/value biases."""
    return (
        isinstance(attention, nn.MultiheadAttention)
        and attention._qkv_same_embed_dim
        and attention.bias_k is None
        and not attention.add_zero_attn
    )


def _linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """A Linear layer over ``weight`` and ``bias`` themselves (shared, not copied)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight, layer.bias = weight, bias
    return layer


class ProjectedAttention(nn.Module):
    """``attention``'s self-attention as ``in_proj``, scaled dot-product attention and
    ``out_proj``; ``attention`` itself for every other call."""

    def __init__(self, attention: nn.MultiheadAttention):
        super().__init__()
        self.heads, self.batch_first = attention.num_heads, attention.batch_first
        self.in_proj = _linear(attention.in_proj_weight, attention.in_proj_bias)
        self.out_proj = _linear(attention.out_proj.weight, attention.out_proj.bias)
        self.attention = attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        plain = key_padding_mask is None and attn_mask is None and not is_causal
        if not (query is key and key is value and query.dim() == 3 and plain) or need_weights:
            return self.attention(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        x = query if self.batch_first else query.transpose(0, 1)
        batch, length, width = x.shape
        packed = self.in_proj(x).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.attention.dropout if self.training else 0.0
        mixed = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        out = self.out_proj(mixed.transpose(1, 2).reshape(batch, length, width))
        return (out if self.batch_first else out.transpose(0, 1)), None


def attention_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s ``nn.MultiheadAttention`` layers that project (and are
    not projected already)."""
    done = {
        f"{name}.attention" if name else "attention"
        for name, each in module.named_modules()
        if isinstance(each, ProjectedAttention)
    }
    return [name for name, each in module.named_modules() if projectable(each) and name not in done]


def with_projected_attention(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with each attention that projects as a ``ProjectedAttention``."""
    module = copy.deepcopy(module)
    for name in attention_names(module):
        if not name:
            return ProjectedAttention(module)
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, ProjectedAttention(getattr(parent, child)))
    return module
