"""nn.MultiheadAttention's self-attention with its projections as Linear layers: the same
answers as the module, on torchvision's ViT and on the calls it does not take."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from bladesmith.passes.projected_attention import (
    ProjectedAttention,
    attention_names,
    with_projected_attention,
)


def _attention(**settings) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, **settings).eval()
    with torch.no_grad():  # torch starts the biases at zero, which would hide them
        attention.in_proj_bias.normal_()
        attention.out_proj.bias.normal_()
    return attention


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_answers_as_the_module_through_its_own_projections(batch_first):
    attention = _attention(batch_first=batch_first)
    projected = ProjectedAttention(attention)
    calls = []
    projected.in_proj.register_forward_hook(lambda *_: calls.append("in"))
    projected.out_proj.register_forward_hook(lambda *_: calls.append("out"))
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        got, weights = projected(x, x, x, need_weights=False)
        expected, _ = attention(x, x, x, need_weights=False)
    assert weights is None and calls == ["in", "out"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_other_call_runs_the_module_itself():
    attention = _attention(batch_first=True)
    projected = ProjectedAttention(attention)
    calls = []
    projected.in_proj.register_forward_hook(lambda *_: calls.append("in"))
    x, other = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, -1] = True
    with torch.no_grad():
        for args, settings in [
            ((x, x, x), {}),  # the weights asked for (need_weights defaults to True)
            ((x, other, other), {"need_weights": False}),  # cross-attention
            ((x, x, x), {"need_weights": False, "key_padding_mask": mask}),
            ((x[0], x[0], x[0]), {"need_weights": False}),  # unbatched
        ]:
            got = projected(*args, **settings)
            expected = attention(*args, **settings)
            for each, wanted in zip(got, expected, strict=True):
                torch.testing.assert_close(each, wanted)
    assert calls == []


def test_only_attention_with_one_packed_projection_and_no_extra_biases_is_projected():
    model = nn.ModuleDict(
        {
            "plain": nn.MultiheadAttention(32, 4),
            "kdim": nn.MultiheadAttention(32, 4, kdim=16, vdim=16),
            "bias_kv": nn.MultiheadAttention(32, 4, add_bias_kv=True),
            "zero_attn": nn.MultiheadAttention(32, 4, add_zero_attn=True),
        }
    )
    assert attention_names(model) == ["plain"]
    projected = with_projected_attention(model)
    assert isinstance(projected["plain"], ProjectedAttention)
    assert isinstance(model["plain"], nn.MultiheadAttention)  # the input untouched
    assert attention_names(projected) == []  # projected once
    assert with_projected_attention(model["plain"]).in_proj.weight.shape == (96, 32)


def test_torchvisions_vit_projected_answers_as_given_and_exports():
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128
    ).eval()
    nn.init.normal_(vit.heads.head.weight)  # torchvision starts it at zero
    projected = with_projected_attention(vit)
    assert attention_names(vit) == [
        f"encoder.layers.encoder_layer_{i}.self_attention" for i in (0, 1)
    ]
    calls = []
    for layer in projected.encoder.layers:
        layer.self_attention.in_proj.register_forward_hook(lambda *_: calls.append(1))
    x = torch.rand(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(projected(x), vit(x), rtol=1e-4, atol=1e-4)
    assert len(calls) == 2
    program = torch.export.export(projected, (x,))  # the branch on `is` traces
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), vit(x), rtol=1e-4, atol=1e-4)
    targets = {str(node.target) for node in program.graph.nodes}
    assert "aten.scaled_dot_product_attention.default" in targets, targets
