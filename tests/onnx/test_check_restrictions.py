"""TensorRT's restrictions from onnx-tensorrt's operators.md (restrictions.json): one
hand-built model per restriction, flagged at its node, and the same node without the
restricted usage passes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bladesmith.onnx.checker import check

h = onnx.helper
T = onnx.TensorProto


def node_model(op, inputs, outputs, opset=22, **attributes):
    """One node named n; inputs/outputs as (name, elem_type, shape), or (name, array) for
    an initializer; '' skips an input."""
    node = h.make_node(
        op, [spec[0] if spec else "" for spec in inputs], [n for n, *_ in outputs], name="n",
        **attributes,
    )  # fmt: skip
    graph = h.make_graph(
        [node],
        "g",
        [h.make_tensor_value_info(*spec) for spec in inputs if spec and len(spec) == 3],
        [h.make_tensor_value_info(*spec) for spec in outputs],
        [onnx.numpy_helper.from_array(*spec[::-1]) for spec in inputs if len(spec) == 2],
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


VECTOR = ("x", T.FLOAT, [2, 4])
AXES = ("axes", T.INT64, [1])
ZERO_AXIS = ("axes", np.array([0]))
INT8_OUT = [("y", T.INT8, [4])]
FLOAT_OUT = [("y", T.FLOAT, [4])]

# TensorRT 8.5 (onnx-tensorrt docs/operators.md at 6d0ab7be): as CASES, at opset 17
TRT8_CASES = {
    "bfloat16": (
        node_model("MatMul", [("a", T.BFLOAT16, [2, 2]), ("b", T.BFLOAT16, [2, 2])],
                   [("c", T.BFLOAT16, [2, 2])], opset=17),
        node_model("MatMul", [("a", T.FLOAT16, [2, 2]), ("b", T.FLOAT16, [2, 2])],
                   [("c", T.FLOAT16, [2, 2])], opset=17),
        "tensor(bfloat16)",
    ),
    "int16": (
        node_model("Max", [("a", T.INT16, [2]), ("b", T.INT16, [2])], [("c", T.INT16, [2])],
                   opset=17),
        node_model("Max", [("a", T.INT32, [2]), ("b", T.INT32, [2])], [("c", T.INT32, [2])],
                   opset=17),
        "tensor(int16)",
    ),
    "topk_k": (
        node_model("TopK", [VECTOR, ("k", T.INT64, [1])], [*POOLED, ("i", T.INT64, None)],
                   opset=17),
        node_model("TopK", [VECTOR, ("k", np.array([2]))], [*POOLED, ("i", T.INT64, None)],
                   opset=17),
        "K must be an initializer",
    ),
    "resize_cubic": (
        node_model("Resize", [IMAGE, "", SCALES], POOLED, mode="cubic", opset=17),
        node_model("Resize", [IMAGE, "", SCALES], POOLED, mode="linear", opset=17),
        "mode=cubic",
    ),
    "resize_crop": (
        node_model("Resize", [IMAGE, ("roi", T.FLOAT, [8]), SCALES], POOLED, opset=17,
                   coordinate_transformation_mode="tf_crop_and_resize"),
        node_model("Resize", [IMAGE, "", SCALES], POOLED, opset=17,
                   coordinate_transformation_mode="pytorch_half_pixel"),
        "tf_crop_and_resize",
    ),
    "slice_axes": (
        node_model("Slice", [VECTOR, ("s", np.array([0])), ("e", np.array([1])), AXES],
                   POOLED, opset=17),
        node_model("Slice", [VECTOR, ("s", np.array([0])), ("e", np.array([1])), ZERO_AXIS],
                   POOLED, opset=17),
        "axes must be an initializer",
    ),
    "squeeze_axes": (
        node_model("Squeeze", [("x", T.FLOAT, [1, 4]), AXES], POOLED, opset=17),
        node_model("Squeeze", [("x", T.FLOAT, [1, 4]), ZERO_AXIS], POOLED, opset=17),
        "axes must be an initializer",
    ),
    "unsqueeze_axes": (
        node_model("Unsqueeze", [VECTOR, AXES], POOLED, opset=17),
        node_model("Unsqueeze", [VECTOR, ZERO_AXIS], POOLED, opset=17),
        "axes must be an initializer",
    ),
    "cumsum_axis": (
        node_model("CumSum", [VECTOR, ("axis", T.INT64, [])], POOLED, opset=17),
        node_model("CumSum", [VECTOR, ("axis", np.array(1))], POOLED, opset=17),
        "axis must be an initializer",
    ),
    "instancenorm_scale": (
        node_model("InstanceNormalization", [IMAGE, ("s", T.FLOAT, [3]),
                                             ("b", np.zeros(3, np.float32))], POOLED, opset=17),
        node_model("InstanceNormalization", [IMAGE, ("s", np.ones(3, np.float32)),
                                             ("b", np.zeros(3, np.float32))], POOLED, opset=17),
        "input s is not a constant",
    ),
    "dequantize_zero_point": (
        node_model("DequantizeLinear", [("q", T.INT8, [4]), ("sc", np.array(0.5, np.float32)),
                                        ("zp", np.array(3, np.int8))], FLOAT_OUT, opset=17),
        node_model("DequantizeLinear", [("q", T.INT8, [4]), ("sc", np.array(0.5, np.float32)),
                                        ("zp", np.array(0, np.int8))], FLOAT_OUT, opset=17),
        "x_zero_point must be zero",
    ),
    "quantize_zero_point": (
        node_model("QuantizeLinear", [("f", T.FLOAT, [4]), ("sc", np.array(0.5, np.float32)),
                                      ("zp", np.array(3, np.int8))], INT8_OUT, opset=17),
        node_model("QuantizeLinear", [("f", T.FLOAT, [4]), ("sc", np.array(0.5, np.float32)),
                                      ("zp", np.array(0, np.int8))], INT8_OUT, opset=17),
        "y_zero_point must be zero",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRT8_CASES))
def test_tensorrt8_restriction_is_an_error_at_its_node(name):
    bad, good, words = TRT8_CASES[name]
    (finding,) = restricted(bad, "tensorrt8")
    assert (finding.node, finding.severity) == ("n", "error")
    assert words in finding.message
    assert "docs/operators.md (TensorRT 8.5, commit 6d0ab7be" in finding.source
    assert restricted(good, "tensorrt8") == []


def test_a_constant_nodes_output_is_a_constant_input_for_tensorrt8():
    """onnx-tensorrt reads a Constant node's output as weights, as it does an initializer."""
    model = TRT8_CASES["topk_k"][0]
    graph = model.graph
    graph.node.insert(0, h.make_node("Constant", [], ["k"], value_ints=[2]))
    graph.input.remove(next(i for i in graph.input if i.name == "k"))
    assert restricted(model, "tensorrt8") == []
