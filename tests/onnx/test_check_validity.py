"""Files that are not a model (exit 2) and graphs that are not valid (one invalid-graph
finding each, exit 1), before any target's rules."""

from __future__ import annotations

import check_models as models
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bladesmith.cli import main
from bladesmith.onnx.checker import NotAModelError, check

h = onnx.helper
FLOAT = onnx.TensorProto.FLOAT


def relu_chain(*edges):
    """Relu nodes given as (input, output) pairs, graph input x, output y."""
    nodes = [h.make_node("Relu", [a], [b], name=f"relu_{b}") for a, b in edges]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", FLOAT, [2])],
        [h.make_tensor_value_info("y", FLOAT, [2])],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def no_opset():
    model = models.relu()
    del model.opset_import[:]
    return model


def no_graph():
    model = models.relu()
    model.ClearField("graph")
    return model


def conv_of_a_3d_input():
    """A 2-D Conv (4-D weights) reading a 3-D input: what `fix --input-shape` with one
    dimension too few once wrote. ONNX Runtime refuses to load it."""
    graph = h.make_graph(
        [h.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[3, 3])],
        "g",
        [h.make_tensor_value_info("x", FLOAT, [1, 3, 8])],
        [h.make_tensor_value_info("y", FLOAT, None)],
        [models.const("w", np.zeros((4, 3, 3, 3)))],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def add_of_float_and_int64():
    graph = h.make_graph(
        [h.make_node("Add", ["a", "b"], ["c"], name="add")],
        "g",
        [
            h.make_tensor_value_info("a", FLOAT, [2]),
            h.make_tensor_value_info("b", onnx.TensorProto.INT64, [2]),
        ],
        [h.make_tensor_value_info("c", FLOAT, [2])],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


INVALID = {
    "inference_rank": (conv_of_a_3d_input, ["strict shape and type inference", "conv"]),
    "inference_type": (add_of_float_and_int64, ["strict shape and type inference", "int64"]),
    "no_graph": (no_graph, ["no graph"]),
    "no_opset": (no_opset, ["imports no opset"]),
    "dangling": (lambda: relu_chain(("x", "a"), ("missing", "y")), ["missing"]),
    "cycle": (lambda: relu_chain(("x", "a"), ("c", "b"), ("b", "c"), ("a", "y")), ["cycle"]),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_each_invalid_graph_is_one_finding(name, tmp_path, capsys):
    build, words = INVALID[name]
    (finding,) = check(build(), ["ort-cpu", "tensorrt"])
    assert (finding.rule, finding.severity, finding.target) == ("invalid-graph", "error", "all")
    assert all(word in finding.message for word in words)
    path = tmp_path / "m.onnx"
    onnx.save(build(), path)
    assert main(["check", str(path), "-t", "all"]) == 1
    assert "invalid-graph" in capsys.readouterr().out


def test_the_cycle_names_its_nodes():
    model = relu_chain(("x", "a"), ("c", "b"), ("b", "c"), ("a", "y"))
    (finding,) = check(model, "ort-cpu")
    assert "relu_b" in finding.message and "relu_c" in finding.message
    assert "relu_a" not in finding.message


@pytest.mark.parametrize("content", [b"", b"not a model at all", None])
def test_files_that_are_not_models_exit_2(content, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(NotAModelError):
        check(path, "ort-cpu")
    assert models.exit_code(["check", str(path), "-t", "ort-cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err


def test_an_empty_model_proto_is_not_a_model():
    with pytest.raises(NotAModelError, match="empty"):
        check(onnx.ModelProto(), "ort-cpu")


@pytest.mark.parametrize("name", ["inference_rank", "inference_type"])
def test_what_strict_inference_rejects_onnxruntime_cannot_load(name):
    with pytest.raises(Exception, match="ShapeInferenceError|TypeInferenceError|type"):
        ort.InferenceSession(INVALID[name][0]().SerializeToString())


def test_an_error_inside_a_function_body_is_not_reported():
    """onnx 1.23 fails to infer MeanVarianceNormalization's body (its Constant takes a
    referenced attribute); ONNX Runtime runs the operator with its own kernel."""
    graph = h.make_graph(
        [h.make_node("MeanVarianceNormalization", ["x"], ["y"], name="mvn")],
        "g",
        [h.make_tensor_value_info("x", FLOAT, [1, 2, 3, 3])],
        [h.make_tensor_value_info("y", FLOAT, [1, 2, 3, 3])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    ort.InferenceSession(model.SerializeToString())  # loads
    assert not [f for f in check(model, "ort-cpu") if f.rule == "invalid-graph"]
