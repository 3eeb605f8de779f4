"""Small hand-built ONNX models, one per `bladesmith check` rule, for the check/fix tests."""

from __future__ import annotations

import numpy as np
import onnx

h = onnx.helper
FLOAT = onnx.TensorProto.FLOAT
INT64 = onnx.TensorProto.INT64


def model(nodes, inputs, outputs, initializers=(), opset=17, domains=()):
    """A checked model: opset for the default domain, version 1 for each custom domain."""
    graph = h.make_graph(nodes, "test", inputs, outputs, list(initializers))
    opsets = [h.make_opsetid("", opset), *(h.make_opsetid(domain, 1) for domain in domains)]
    built = h.make_model(graph, opset_imports=opsets)
    built.ir_version = 9
    if not domains:
        onnx.checker.check_model(built, full_check=True)
    return built


def const(name, value, dtype=np.float32):
    return onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def image_input(static=False):
    dims = [1, 3, 8, 8] if static else [1, 3, "H", "W"]
    return h.make_tensor_value_info("x", FLOAT, dims)


def float_resize_sizes(static=False, factor=2.0, rounding="Floor"):
    """Conv -> Shape -> Cast(float) -> Mul(factor) -> Floor -> Cast(int64) -> Resize(sizes):
    the float-into-shape pattern exporters emit for `interpolate(scale_factor=2)`."""
    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [
        h.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Shape", ["c"], ["s"], name="shape"),
        h.make_node("Cast", ["s"], ["sf"], name="cast_f", to=FLOAT),
        h.make_node("Mul", ["sf", "factor"], ["sm"], name="mul"),
        h.make_node(rounding, ["sm"], ["sr"], name="round"),
        h.make_node("Cast", ["sr"], ["si"], name="cast_i", to=INT64),
        h.make_node("Resize", ["c", "", "", "si"], ["y"], name="resize", mode="nearest"),
    ]
    return model(
        nodes,
        [image_input(static)],
        [h.make_tensor_value_info("y", FLOAT, [1, 4, None, None])],
        [const("w", weight), const("factor", factor)],
    )


def half_size_constant_of_shape(rounding="Ceil"):
    """Shape -> Cast(float) -> Div(2) -> Ceil|Floor -> Cast(int64) -> ConstantOfShape."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"], name="shape"),
        h.make_node("Cast", ["s"], ["sf"], name="cast_f", to=FLOAT),
        h.make_node("Div", ["sf", "two"], ["sd"], name="div"),
        h.make_node(rounding, ["sd"], ["sr"], name="round"),
        h.make_node("Cast", ["sr"], ["si"], name="cast_i", to=INT64),
        h.make_node("ConstantOfShape", ["si"], ["y"], name="fill", value=const("one", [1.0])),
    ]
    return model(
        nodes,
        [image_input()],
        [h.make_tensor_value_info("y", FLOAT, [None, None, None, None])],
        [const("two", 2.0)],
    )


def float_reshape_without_rounding():
    """Shape -> Cast(float) -> Mul(1) -> Cast(int64) -> Reshape: only shape layers."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"], name="shape"),
        h.make_node("Cast", ["s"], ["sf"], name="cast_f", to=FLOAT),
        h.make_node("Mul", ["sf", "one"], ["sm"], name="mul"),
        h.make_node("Cast", ["sm"], ["si"], name="cast_i", to=INT64),
        h.make_node("Reshape", ["x", "si"], ["y"], name="reshape"),
    ]
    return model(
        nodes,
        [image_input()],
        [h.make_tensor_value_info("y", FLOAT, [1, 3, None, None])],
        [const("one", 1.0)],
    )


def resize_scales_from_input():
    """Resize whose float scales are a graph input."""
    nodes = [h.make_node("Resize", ["x", "", "scales"], ["y"], name="resize", mode="nearest")]
    return model(
        nodes,
        [image_input(static=True), h.make_tensor_value_info("scales", FLOAT, [4])],
        [h.make_tensor_value_info("y", FLOAT, [None, None, None, None])],
    )


def plugin_feeds_reshape():
    """A custom-domain node computes the shape that Reshape uses."""
    nodes = [
        h.make_node("TargetShape", ["x"], ["shape"], name="plugin", domain="my.plugins"),
        h.make_node("Reshape", ["x", "shape"], ["y"], name="reshape"),
    ]
    return model(
        nodes,
        [image_input(static=True)],
        [h.make_tensor_value_info("y", FLOAT, [None, None, None, None])],
        domains=["my.plugins"],
    )


def custom_nodes_of_three_kinds():
    """A node of bladesmith's own operators (custom_ops="domain"), one of
    onnxruntime-extensions' own (same domain) and one of another library's domain."""
    nodes = [
        h.make_node("BladesmithBatchedNms", ["x"], ["a"], name="ours", domain="ai.onnx.contrib"),
        h.make_node("Inverse", ["a"], ["b"], name="extensions", domain="ai.onnx.contrib"),
        h.make_node("TargetShape", ["b"], ["y"], name="plugin", domain="my.plugins"),
    ]
    return model(
        nodes,
        [image_input(static=True)],
        [h.make_tensor_value_info("y", FLOAT, None)],
        domains=["ai.onnx.contrib", "my.plugins"],
    )


def relu(opset=17, static=True):
    nodes = [h.make_node("Relu", ["x"], ["y"], name="relu")]
    shape = [1, 3, 8, 8] if static else ["N", 3, 8, 8]
    return model(
        nodes,
        [h.make_tensor_value_info("x", FLOAT, shape)],
        [h.make_tensor_value_info("y", FLOAT, shape)],
        opset=opset,
    )


def reduce_mean(opset=21):
    """ReduceMean with axes as an input (opset 18 or newer); 21 is above DirectML's 20."""
    nodes = [h.make_node("ReduceMean", ["x", "axes"], ["y"], name="mean", keepdims=1)]
    return model(
        nodes,
        [h.make_tensor_value_info("x", FLOAT, [1, 3, 8, 8])],
        [h.make_tensor_value_info("y", FLOAT, [1, 3, 1, 1])],
        [const("axes", [2, 3], np.int64)],
        opset=opset,
    )


def unique():
    """Unique: CPU-only in ONNX Runtime, not in TensorRT, data-dependent output size."""
    nodes = [h.make_node("Unique", ["x"], ["y"], name="unique", sorted=1)]
    return model(
        nodes,
        [h.make_tensor_value_info("x", FLOAT, [6])],
        [h.make_tensor_value_info("y", FLOAT, [None])],
    )


def int64_arithmetic():
    """An INT64 input plus a constant beyond INT32, and a Slice whose end is INT64_MAX."""
    big = np.iinfo(np.int64).max
    nodes = [
        h.make_node("Add", ["i", "big"], ["j"], name="add"),
        h.make_node("Slice", ["j", "start", "end"], ["y"], name="slice"),
    ]
    return model(
        nodes,
        [h.make_tensor_value_info("i", INT64, [4])],
        [h.make_tensor_value_info("y", INT64, [None])],
        [
            const("big", [2**40], np.int64),
            const("start", [1], np.int64),
            const("end", [big], np.int64),
        ],
    )


def empty_tensor():
    """A graph input with a zero-size dimension."""
    nodes = [h.make_node("Relu", ["x"], ["y"], name="relu")]
    return model(
        nodes,
        [h.make_tensor_value_info("x", FLOAT, [0, 4])],
        [h.make_tensor_value_info("y", FLOAT, [0, 4])],
    )


def empty_placeholders():
    """What torch exports at opset 11 for interpolate(size=...): Resize with empty
    Constant tensors for its unused roi and scales; and the shape of a 0-D tensor, empty
    as a shape vector is for a scalar, fed to ConstantOfShape."""
    empty = onnx.numpy_helper.from_array(np.zeros(0, np.float32))
    nodes = [
        h.make_node("Constant", [], ["roi"], name="roi", value=empty),
        h.make_node("Constant", [], ["scales"], name="scales", value=empty),
        h.make_node("Resize", ["x", "roi", "scales", "sizes"], ["y"], name="resize"),
        h.make_node("Shape", ["t"], ["scalar_shape"], name="shape"),
        h.make_node("ConstantOfShape", ["scalar_shape"], ["z"], name="fill"),
    ]
    return model(
        nodes,
        [image_input(static=True), h.make_tensor_value_info("t", FLOAT, [])],
        [
            h.make_tensor_value_info("y", FLOAT, [1, 3, 16, 16]),
            h.make_tensor_value_info("z", FLOAT, []),
        ],
        [const("sizes", [1, 3, 16, 16], np.int64)],
        opset=11,
    )


def sliced_empty():
    """x[2:2], an empty slice of the data."""
    nodes = [h.make_node("Slice", ["x", "start", "start"], ["y"], name="slice")]
    return model(
        nodes,
        [h.make_tensor_value_info("x", FLOAT, [4])],
        [h.make_tensor_value_info("y", FLOAT, [0])],
        [const("start", [2], np.int64)],
    )


def sliced_shape_floor_division():
    """x.shape[2:] // 2 as exporters write it in floats: Shape -> Slice(2:) -> Cast(float)
    -> Div(2) -> Floor -> Cast(int64), the spatial sizes of a Resize."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"], name="shape"),
        h.make_node("Slice", ["s", "start", "end"], ["hw"], name="spatial"),
        h.make_node("Cast", ["hw"], ["hwf"], name="cast_f", to=FLOAT),
        h.make_node("Div", ["hwf", "two"], ["half"], name="div"),
        h.make_node("Floor", ["half"], ["halfr"], name="floor"),
        h.make_node("Cast", ["halfr"], ["hwi"], name="cast_i", to=INT64),
        h.make_node("Slice", ["s", "zero", "start"], ["nc"], name="batch_channels"),
        h.make_node("Concat", ["nc", "hwi"], ["sizes"], name="sizes", axis=0),
        h.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="resize", mode="nearest"),
    ]
    return model(
        nodes,
        [image_input()],
        [h.make_tensor_value_info("y", FLOAT, [1, 3, None, None])],
        [
            const("two", 2.0),
            const("start", [2], np.int64),
            const("end", [4], np.int64),
            const("zero", [0], np.int64),
        ],
    )


def float_reshape_in_if(dims=(2, 3)):
    """Shape -> Cast(float) -> Floor -> Cast(int64) -> Reshape inside an If's then-branch."""
    then_branch = h.make_graph(
        [
            h.make_node("Shape", ["x"], ["s"], name="shape"),
            h.make_node("Cast", ["s"], ["sf"], name="cast_f", to=FLOAT),
            h.make_node("Floor", ["sf"], ["sr"], name="floor"),
            h.make_node("Cast", ["sr"], ["si"], name="cast_i", to=INT64),
            h.make_node("Reshape", ["x", "si"], ["t"], name="reshape"),
        ],
        "then",
        [],
        [h.make_tensor_value_info("t", FLOAT, dims)],
    )
    else_branch = h.make_graph(
        [h.make_node("Identity", ["x"], ["e"], name="same")],
        "else",
        [],
        [h.make_tensor_value_info("e", FLOAT, dims)],
    )
    branch = h.make_node(
        "If", ["c"], ["y"], name="if", then_branch=then_branch, else_branch=else_branch
    )
    return model(
        [branch],
        [
            h.make_tensor_value_info("x", FLOAT, dims),
            h.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
        [h.make_tensor_value_info("y", FLOAT, dims)],
    )


def nonzero_in_loop():
    """A Loop whose body counts the nonzero elements of x with NonZero."""
    body = h.make_graph(
        [
            h.make_node("Identity", ["cond"], ["cond_out"], name="keep_going"),
            h.make_node("NonZero", ["v"], ["nz"], name="nonzero"),
            h.make_node("Identity", ["v"], ["v_out"], name="carry"),
            h.make_node("ReduceSum", ["nz"], ["count"], name="count", keepdims=0),
        ],
        "body",
        [
            h.make_tensor_value_info("i", INT64, []),
            h.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("v", FLOAT, [4]),
        ],
        [
            h.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("v_out", FLOAT, [4]),
            h.make_tensor_value_info("count", INT64, []),
        ],
    )
    loop = h.make_node("Loop", ["n", "", "x"], ["x_out", "counts"], name="loop", body=body)
    return model(
        [loop],
        [h.make_tensor_value_info("n", INT64, []), h.make_tensor_value_info("x", FLOAT, [4])],
        [
            h.make_tensor_value_info("x_out", FLOAT, [4]),
            h.make_tensor_value_info("counts", INT64, ["k"]),
        ],
    )


def exit_code(argv: list[str]) -> int:
    """main's exit code, whether the command returns it or argparse stops at an argument
    (a file to read that is missing or empty is refused there)."""
    try:
        from bladesmith.cli import main

        return main(argv)
    except SystemExit as stopped:
        return stopped.code
