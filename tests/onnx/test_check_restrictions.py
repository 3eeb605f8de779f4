"""TensorRT's restrictions from onnx-tensorrt's operators.md (restrictions.json): one
hand-built model per restriction, flagged at its node, and the same node without the
restricted usage passes."""

from __future__ import annotations

import onnx
import pytest

from bladesmith.onnx.checker import check

h = onnx.helper
T = onnx.TensorProto


def node_model(op, inputs, outputs, opset=22, **attributes):
    """One node named n; inputs/outputs as (name, elem_type, shape); '' skips an input."""
    node = h.make_node(
        op, [spec[0] if spec else "" for spec in inputs], [n for n, *_ in outputs], name="n",
        **attributes,
    )  # fmt: skip
    graph = h.make_graph(
        [node],
        "g",
        [h.make_tensor_value_info(*spec) for spec in inputs if spec],
        [h.make_tensor_value_info(*spec) for spec in outputs],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 10
    return model


IMAGE = ("x", T.FLOAT, [1, 3, 8, 8])
SCALES = ("scales", T.FLOAT, [4])
POOLED = [("y", T.FLOAT, None)]

# name -> (restricted model, the same without the restriction, words in the message)
CASES = {
    "int16": (
        node_model("Add", [("a", T.INT16, [2]), ("b", T.INT16, [2])], [("c", T.INT16, [2])]),
        node_model("Add", [("a", T.INT32, [2]), ("b", T.INT32, [2])], [("c", T.INT32, [2])]),
        "tensor(int16)",
    ),
    "uint64": (
        node_model("Identity", [("a", T.UINT64, [2])], [("b", T.UINT64, [2])]),
        node_model("Identity", [("a", T.INT64, [2])], [("b", T.INT64, [2])]),
        "tensor(uint64)",
    ),
    "resize_cubic": (
        node_model("Resize", [IMAGE, "", SCALES], POOLED, mode="cubic"),
        node_model("Resize", [IMAGE, "", SCALES], POOLED, mode="linear"),
        "mode=cubic",
    ),
    "resize_antialias": (
        node_model("Resize", [IMAGE, "", SCALES], POOLED, mode="linear", antialias=1),
        node_model("Resize", [IMAGE, "", SCALES], POOLED, mode="linear", antialias=0),
        "antialias=1",
    ),
    "resize_crop": (
        node_model("Resize", [IMAGE, ("roi", T.FLOAT, [8]), SCALES], POOLED,
                   coordinate_transformation_mode="tf_crop_and_resize"),
        node_model("Resize", [IMAGE, "", SCALES], POOLED,
                   coordinate_transformation_mode="align_corners"),
        "tf_crop_and_resize",
    ),
    "pool_dilations": (
        node_model("MaxPool", [IMAGE], POOLED, kernel_shape=[2, 2], dilations=[2, 2]),
        node_model("MaxPool", [IMAGE], POOLED, kernel_shape=[2, 2], dilations=[1, 1]),
        "dilations",
    ),
    "pool_1d": (
        node_model("AveragePool", [("x", T.FLOAT, [1, 3, 8])], POOLED, kernel_shape=[2]),
        node_model("AveragePool", [IMAGE], POOLED, kernel_shape=[2, 2]),
        "1-D",
    ),
    "maxpool_indices": (
        node_model("MaxPool", [IMAGE], [*POOLED, ("i", T.INT64, None)], kernel_shape=[2, 2]),
        node_model("MaxPool", [IMAGE], POOLED, kernel_shape=[2, 2]),
        "Indices",
    ),
    "layernorm_outputs": (
        node_model("LayerNormalization", [IMAGE, ("s", T.FLOAT, [8])],
                   [*POOLED, ("mean", T.FLOAT, None), ("inv", T.FLOAT, None)]),
        node_model("LayerNormalization", [IMAGE, ("s", T.FLOAT, [8])], POOLED),
        "InvStdDev",
    ),
    "scatternd_reduction": (
        node_model("ScatterND", [("d", T.FLOAT, [4]), ("i", T.INT64, [1, 1]),
                                 ("u", T.FLOAT, [1])], POOLED, reduction="add"),
        node_model("ScatterND", [("d", T.FLOAT, [4]), ("i", T.INT64, [1, 1]),
                                 ("u", T.FLOAT, [1])], POOLED),
        "reduction=add",
    ),
    "gru_layout": (
        node_model("GRU", [("x", T.FLOAT, [2, 3, 4]), ("w", T.FLOAT, [1, 15, 4]),
                           ("r", T.FLOAT, [1, 15, 5])], POOLED, hidden_size=5, layout=1),
        node_model("GRU", [("x", T.FLOAT, [2, 3, 4]), ("w", T.FLOAT, [1, 15, 4]),
                           ("r", T.FLOAT, [1, 15, 5])], POOLED, hidden_size=5),
        "layout=1",
    ),
    "attention_past": (
        node_model("Attention", [("q", T.FLOAT, [1, 2, 4, 8]), ("k", T.FLOAT, [1, 2, 4, 8]),
                                 ("v", T.FLOAT, [1, 2, 4, 8]), "",
                                 ("pk", T.FLOAT, [1, 2, 3, 8]), ("pv", T.FLOAT, [1, 2, 3, 8])],
                   POOLED, opset=23),
        node_model("Attention", [("q", T.FLOAT, [1, 2, 4, 8]), ("k", T.FLOAT, [1, 2, 4, 8]),
                                 ("v", T.FLOAT, [1, 2, 4, 8])], POOLED, opset=23),
        "past",
    ),
}  # fmt: skip


def restricted(model, target="tensorrt"):
    return [f for f in check(model, target) if f.rule == "unsupported-usage"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_restriction_is_an_error_at_its_node(name):
    bad, good, words = CASES[name]
    (finding,) = restricted(bad)
    assert (finding.node, finding.severity) == ("n", "error")
    assert words in finding.message
    assert "onnx-tensorrt" in finding.source and "restrictions.json" in finding.source
    assert restricted(good) == []


def test_restrictions_belong_to_their_target():
    bad, _, _ = CASES["resize_cubic"]
    assert restricted(bad, "ort-cpu") == []
    assert restricted(CASES["pool_1d"][0], "tensorrt8")  # TensorRT 8.5: 2-D or 3-D only
