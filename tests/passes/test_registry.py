"""The pass registry: the built-in passes in ORDER, duplicates and bad levels refused."""

from __future__ import annotations

import pytest

from bladesmith.passes import Pass, registry


def test_registry_lists_builtin_passes_in_order_and_refuses_duplicates():
    assert registry.names() == [
        "fixed_shape",
        "head_packing",
        "fp16",
        "bf16",
        "winograd",
        "norm_folding",
        "channels_last",
        "conv_fusion",
        "channel_padding",
        "roi_heads_bf16",
        "linear_bf16",
        "inductor",
        "fp8",
        "fp8_static",
        "fp8_mixed",
        "torchscript",
        "cudnn_benchmark",
        "cuda_graph",
        "onnxruntime",
        "openvino",
        "openvino_f32",
        "openvino_int8",
        "openvino_int8_mixed",
    ]
    summaries = {name: summary for name, _, _, summary in registry.describe()}
    assert all(summaries.values()), summaries

    class Impostor(Pass):
        name = "fp16"

    with pytest.raises(ValueError, match="already registered"):
        registry.register(Impostor)

    class BadLevel(Pass):
        name = "bad_level"
        levels = ("o9",)

    with pytest.raises(ValueError, match="unknown levels"):
        registry.register(BadLevel)
