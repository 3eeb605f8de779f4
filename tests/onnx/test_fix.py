"""`fix`: each rewrite on a hand-built model, and the fixed model computes the same
outputs as the original in ONNX Runtime."""

from __future__ import annotations

import importlib
import warnings

import check_models as models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from bladesmith.errors import BladesmithError
from bladesmith.onnx import fixes
from bladesmith.onnx.fixer import FixError, InvalidInputError, Rewrite, fix

fix_module = importlib.import_module("bladesmith.onnx.fixer")
h = onnx.helper


def replace_opset_conversion(monkeypatch, apply):
    """fix's opset-conversion step rewritten by `apply(model, context)` instead."""
    steps = [
        fixes.Fix(step.kind, step.resolves, apply) if step.kind == "opset-conversion" else step
        for step in fixes.STEPS
    ]
    monkeypatch.setattr(fixes, "STEPS", tuple(steps))


def run(model_or_path, feeds):
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def images(height, width):
    return {
        "x": np.random.default_rng(height).standard_normal((1, 3, height, width)).astype(np.float32)
    }


def save(model, tmp_path, name="in.onnx"):
    path = tmp_path / name
    onnx.save(model, path)
    return path


def test_dynamic_float_sizes_become_integer_arithmetic(tmp_path):
    original = models.float_resize_sizes()
    out = tmp_path / "out.onnx"
    result = fix(save(original, tmp_path), out, "tensorrt")

    (rewrite,) = [r for r in result.applied if r.kind == "integer-shape-arithmetic"]
    assert rewrite.nodes == ("cast_f", "mul", "round", "cast_i")
    assert "int64" in rewrite.detail
    assert any(f.rule == "float-shape-arithmetic" for f in result.before)
    assert not any(f.rule == "float-shape-arithmetic" for f in result.remaining)
    assert result.verification.status == "unverified"  # dynamic input and no input_shapes
    assert not result.passed  # no errors left, but the outputs were not compared

    fixed = onnx.load(out)
    assert [n.op_type for n in fixed.graph.node] == ["Conv", "Shape", "Mul", "Resize"]
    for height, width in [(5, 7), (8, 8), (13, 4)]:
        expected, actual = (
            run(original, images(height, width)),
            run(str(out), images(height, width)),
        )
        assert expected[0].shape == (2, 8, 2 * height, 2 * width)  # every dim doubled
        np.testing.assert_array_equal(actual[0], expected[0])


@pytest.mark.parametrize("rounding", ["Ceil", "Floor"])
def test_division_then_rounding_becomes_integer_division(tmp_path, rounding):
    original = models.half_size_constant_of_shape(rounding)
    out = tmp_path / "out.onnx"
    result = fix(save(original, tmp_path), out, "tensorrt")
    assert [r.kind for r in result.applied] == ["integer-shape-arithmetic", "unused-initializers"]
    assert "two" in result.applied[1].detail  # the float divisor nothing reads any more
    assert not any(f.rule == "float-shape-arithmetic" for f in result.remaining)
    for height, width in [(5, 7), (6, 9)]:
        expected, actual = (
            run(original, images(height, width)),
            run(str(out), images(height, width)),
        )
        assert actual[0].shape == expected[0].shape


def test_static_shapes_are_folded_away_and_verified(tmp_path):
    out = tmp_path / "out.onnx"
    result = fix(
        save(models.float_resize_sizes(static=True), tmp_path), out, ["tensorrt", "directml"]
    )
    (fold,) = result.applied
    assert fold.kind == "constant-fold"
    assert {"shape", "cast_f", "mul", "round", "cast_i"} <= set(fold.nodes)
    assert [n.op_type for n in onnx.load(out).graph.node] == ["Conv", "Resize"]
    assert result.remaining == []
    assert result.verification.status == "passed"
    assert set(result.verification.outputs) == {"y"}


def test_input_shapes_make_a_dynamic_model_static_then_fold_and_verify(tmp_path):
    out = tmp_path / "out.onnx"
    result = fix(
        save(models.float_resize_sizes(), tmp_path),
        out,
        "tensorrt",
        input_shapes={"x": [1, 3, 6, 10]},
    )
    assert [r.kind for r in result.applied] == ["static-input-shapes", "constant-fold"]
    assert result.verification.status == "passed"
    assert result.remaining == []
    dims = [d.dim_value for d in onnx.load(out).graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 6, 10]


@pytest.mark.parametrize("rounding", ["Floor", "Ceil"])
def test_a_non_integer_factor_with_a_power_of_two_denominator_becomes_integer(tmp_path, rounding):
    original = models.float_resize_sizes(factor=1.5, rounding=rounding)
    out = tmp_path / "out.onnx"
    result = fix(save(original, tmp_path), out, "tensorrt")
    (rewrite,) = [r for r in result.applied if r.kind == "integer-shape-arithmetic"]
    assert "Mul -> Div" in rewrite.detail or "Mul -> Add -> Div" in rewrite.detail
    assert not any(f.rule == "float-shape-arithmetic" for f in result.remaining)
    for height, width in [(5, 7), (8, 8), (13, 3)]:  # odd sizes: 7 * 1.5 = 10.5
        expected = run(original, images(height, width))
        actual = run(str(out), images(height, width))
        assert actual[0].shape == expected[0].shape
        np.testing.assert_array_equal(actual[0], expected[0])


def test_inexact_float_arithmetic_is_left_alone_and_still_reported(tmp_path):
    result = fix(
        save(models.float_resize_sizes(factor=1.1), tmp_path), tmp_path / "out.onnx", "tensorrt"
    )
    assert not [r for r in result.applied if r.kind == "integer-shape-arithmetic"]
    assert any(f.rule == "float-shape-arithmetic" for f in result.remaining)
    assert not result.passed


def test_a_chain_whose_last_cast_is_inside_an_if_body_is_left_as_it_was(tmp_path):
    """fix does not rewrite bodies: Shape -> Cast(float) -> Floor in the main graph, read
    by the Cast(int64) of an If's branch, stays, and the rest of the fix goes on."""
    model = models.float_reshape_in_if(dims=("n", 3))
    then_branch = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    outer = list(then_branch.node[:3])  # shape, cast_f, floor
    del then_branch.node[:3]
    for index, node in enumerate(outer):
        model.graph.node.insert(index, node)
    result = fix(save(model, tmp_path), tmp_path / "out.onnx", "tensorrt")
    assert result.applied == []  # not even a skipped rewrite
    assert [f.node for f in result.remaining if f.rule == "float-shape-arithmetic"] == ["reshape"]


def test_a_sliced_shape_divided_then_floored_becomes_integer_division(tmp_path):
    original = models.sliced_shape_floor_division()
    out = tmp_path / "out.onnx"
    result = fix(save(original, tmp_path), out, "tensorrt")
    assert any(f.rule == "float-shape-arithmetic" for f in result.before)
    (rewrite,) = [r for r in result.applied if r.kind == "integer-shape-arithmetic"]
    assert rewrite.detail.startswith("Cast -> Div -> Floor -> Cast became Div")
    assert not [f for f in result.remaining if f.severity == "error"]
    for height, width in [(5, 7), (8, 8)]:
        expected, actual = (
            run(original, images(height, width)),
            run(str(out), images(height, width)),
        )
        np.testing.assert_array_equal(actual[0], expected[0])


def without_shape(values, name):
    next(v for v in values if v.name == name).type.tensor_type.ClearField("shape")


def test_an_output_without_a_shape_gets_the_inferred_one_and_the_fix_goes_on(tmp_path):
    """onnx's checker refuses a graph output without a shape (ONNX Runtime runs it), so
    every rewrite of such a model was refused by the checker."""
    model = models.float_resize_sizes()
    without_shape(model.graph.output, "y")
    out = tmp_path / "out.onnx"
    result = fix(save(model, tmp_path), out, "tensorrt")
    assert [r.kind for r in result.applied][:2] == ["output-shapes", "integer-shape-arithmetic"]
    assert "y (rank 4)" in result.applied[0].detail
    assert not any(f.rule == "float-shape-arithmetic" for f in result.remaining)
    assert len(onnx.load(out).graph.output[0].type.tensor_type.shape.dim) == 4


@pytest.mark.parametrize("where", ["input", "output"])
def test_a_shape_fix_cannot_declare_is_refused_naming_the_value(where, tmp_path):
    model = models.plugin_feeds_reshape()  # a plugin's output: onnx infers nothing for y
    without_shape(getattr(model.graph, where), "x" if where == "input" else "y")
    out = tmp_path / "out.onnx"
    with pytest.raises(InvalidInputError, match=f"graph {where} '[xy]' declares no shape"):
        fix(save(model, tmp_path), out, "tensorrt")
    assert not out.exists()


def test_an_input_without_a_shape_takes_the_one_given(tmp_path):
    model = models.relu()
    without_shape(model.graph.input, "x")
    source, out = save(model, tmp_path), tmp_path / "out.onnx"
    with pytest.raises(InvalidInputError, match="give it with --input-shape x:D0,D1"):
        fix(source, out, "ort-cpu")
    result = fix(source, out, "ort-cpu", input_shapes={"x": [1, 3, 8, 8]})
    assert result.verification.status == "passed"


def test_opset_is_converted_down_to_the_directml_ceiling(tmp_path):
    out = tmp_path / "out.onnx"
    result = fix(save(models.reduce_mean(21), tmp_path), out, "directml")
    (conversion,) = [r for r in result.applied if r.kind == "opset-conversion"]
    assert "21 -> 20" in conversion.detail
    assert onnx.load(out).opset_import[0].version == 20
    assert result.remaining == []
    assert result.verification.status == "passed"


def test_outputs_that_change_raise_and_write_nothing(tmp_path, monkeypatch):
    def break_model(model, context):
        model.graph.initializer[0].CopyFrom(models.const("w", np.zeros((4, 3, 3, 3))))
        return model

    replace_opset_conversion(monkeypatch, break_model)
    out = tmp_path / "out.onnx"
    with pytest.raises(FixError, match="outputs differ"):
        fix(save(models.float_resize_sizes(static=True), tmp_path), out, "tensorrt")
    assert not out.exists()


def test_unknown_input_shape_name_is_a_clear_error(tmp_path):
    with pytest.raises(BladesmithError, match="not graph inputs"):
        fix(save(models.relu(), tmp_path), tmp_path / "o.onnx", "ort-cpu", input_shapes={"y": [1]})


def test_result_serialises(tmp_path):
    result = fix(save(models.float_resize_sizes(), tmp_path), tmp_path / "o.onnx", "tensorrt")
    data = result.to_dict()
    assert data["applied"][0]["kind"] == "integer-shape-arithmetic"
    assert data["verification"]["status"] == "unverified"
    assert data["passed"] is False  # as exit code 3 says: not verified


def test_a_rewrite_the_checker_rejects_is_skipped_with_its_reason(tmp_path, monkeypatch):
    def break_model(model, context):
        context.applied.append(Rewrite("opset-conversion", (), "opset 21 -> 20"))
        model.graph.node.append(onnx.helper.make_node("Relu", ["nowhere"], ["z"], name="bad"))
        return model

    replace_opset_conversion(monkeypatch, break_model)
    out = tmp_path / "out.onnx"
    result = fix(save(models.relu(), tmp_path), out, "directml")
    (conversion,) = result.applied
    assert conversion.kind == "opset-conversion" and conversion.detail.startswith("skipped: ")
    assert "nowhere" in conversion.detail
    assert [n.name for n in onnx.load(out).graph.node] == ["relu"]
    assert result.verification.status == "passed"


def test_reduce_mean_18_converts_down_for_tensorrt8(tmp_path):
    out = tmp_path / "out.onnx"
    result = fix(save(models.reduce_mean(18), tmp_path), out, "tensorrt8")
    assert onnx.load(out).opset_import[0].version == 17
    assert result.verification.status == "passed" and result.remaining == []


@pytest.mark.parametrize(
    ("dims", "words"),
    [
        ([1, 3, 6], "has 3 dimensions, but input 'x' has 4 (1,3,?,?); give 4"),
        ([1, 3, 6, 10, 1], "has 5 dimensions"),
        ([1, 3, 0, 10], "every dimension must be >= 1"),
        ([2, 3, 6, 10], "changes static dimension 0"),
        ([1, 3, 6, 10**20], "beyond int64"),
        ([1, 3, 2**31, 2**31], "beyond int64"),  # each fits, not their product
    ],
)
def test_input_shapes_that_do_not_fit_the_input_are_refused(tmp_path, dims, words):
    """A shape of another rank once gave a model ONNX Runtime cannot load (Conv:
    "Attribute dilations has incorrect size")."""
    out = tmp_path / "out.onnx"
    source = save(models.float_resize_sizes(), tmp_path)
    with pytest.raises(InvalidInputError) as raised:
        fix(source, out, "ort-cpu", input_shapes={"x": dims})
    assert words in str(raised.value) and "--input-shape" in str(raised.value)
    assert not out.exists()


def one_node(node, output_shape):
    """`node` reading x of shape [1, L], with constants c: [-1, 2] and i: 5."""
    return models.model(
        [node],
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "L"])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, output_shape)],
        [models.const("c", [-1, 2], np.int64), models.const("i", 5, np.int64)],
    )


RESHAPE_INTO_PAIRS = (h.make_node("Reshape", ["x", "c"], ["y"]), [None, 2])
GATHER_FIFTH = (h.make_node("Gather", ["x", "i"], ["y"], axis=1), [1])


@pytest.mark.parametrize(
    ("case", "length", "verify", "words"),
    [  # 7 elements into pairs: onnx's strict inference says so once the shape is static
        (RESHAPE_INTO_PAIRS, 7, True, "strict shape"),
        (RESHAPE_INTO_PAIRS, 7, False, "strict shape"),
        (GATHER_FIFTH, 3, True, "ONNX Runtime CPU"),  # element 5 of 3: only a run shows it
    ],
)
def test_a_shape_the_model_cannot_run_at_is_refused(case, length, verify, words, tmp_path):
    out = tmp_path / "out.onnx"
    source = save(one_node(*case), tmp_path)
    with pytest.raises(InvalidInputError, match="cannot run at this shape") as raised:
        fix(source, out, "ort-cpu", input_shapes={"x": [1, length]}, verify=verify)
    assert f"--input-shape) x:1,{length}" in str(raised.value) and words in str(raised.value)
    assert not out.exists()
    fix(source, out, "ort-cpu", input_shapes={"x": [1, 8]}, verify=verify)  # one it runs at


def test_inputs_too_large_to_make_leave_the_fix_unverified(tmp_path):
    result = fix(save(models.relu(static=False), tmp_path), tmp_path / "out.onnx", "ort-cpu",
                 input_shapes={"x": [2**40, 3, 8, 8]})  # fmt: skip
    assert result.verification.status == "unverified"
    assert "Unable to allocate" in result.verification.reason


def unused_input(initializer=False):
    """Relu of x, and an input `unused` nothing reads (with a default value when
    `initializer`: an initializer listed as a graph input)."""
    inputs = [
        h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
        h.make_tensor_value_info("unused", onnx.TensorProto.FLOAT, [2, 3]),
    ]
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        inputs,
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [models.const("unused", np.ones((2, 3)))] if initializer else [],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


@pytest.mark.parametrize("initializer", [False, True])
def test_inputs_nothing_reads_are_kept(tmp_path, initializer):
    out = tmp_path / "out.onnx"
    result = fix(save(unused_input(initializer), tmp_path), out, "ort-cpu")
    assert result.verification.status == "passed"
    fixed = onnx.load(out)
    assert [i.name for i in fixed.graph.input] == ["x", "unused"]
    assert ("unused" in {i.name for i in fixed.graph.initializer}) == initializer
    feeds = {"x": np.ones((2, 3), np.float32), "unused": np.zeros((2, 3), np.float32)}
    run(str(out), feeds)  # callers still feed it


def test_an_output_that_is_the_input_is_refused(tmp_path):
    source = save(models.relu(), tmp_path)
    before = source.read_bytes()
    link = tmp_path / "link.onnx"
    link.symlink_to(source)
    for out in (source, link, tmp_path / "." / source.name):
        with pytest.raises(InvalidInputError, match="is the input model itself"):
            fix(source, out, "ort-cpu")
    assert source.read_bytes() == before


def test_a_rewrite_that_changes_an_inputs_rank_is_skipped(tmp_path, monkeypatch):
    def drop_a_dimension(model, context):
        context.applied.append(Rewrite("opset-conversion", (), "opset 21 -> 20"))
        del model.graph.input[0].type.tensor_type.shape.dim[0]
        return model

    replace_opset_conversion(monkeypatch, drop_a_dimension)
    result = fix(save(models.relu(), tmp_path), tmp_path / "out.onnx", "directml")
    (conversion,) = result.applied
    assert conversion.detail == (
        "skipped: it would change the model's interface: input 'x' changed rank 4 -> 3"
    )


def test_a_fixed_model_that_cannot_run_on_the_inputs_is_not_said_to_differ(tmp_path, monkeypatch):
    """When ONNX Runtime cannot run the fixed model on the original's inputs, no outputs
    were compared: the error says so instead of "outputs differ"."""

    def drop_a_dimension(model, context):
        del model.graph.input[0].type.tensor_type.shape.dim[0]
        del model.graph.output[0].type.tensor_type.shape.dim[0]
        return model

    replace_opset_conversion(monkeypatch, drop_a_dimension)
    monkeypatch.setattr(fix_module, "_same_interface", lambda before, after: None)
    out = tmp_path / "out.onnx"
    with pytest.raises(FixError) as raised:
        fix(save(models.relu(), tmp_path), out, "ort-cpu")
    message = str(raised.value)
    assert "could not be verified" in message and "no outputs were compared" in message
    assert "Invalid rank for input: x" in message and "differ" not in message
    assert not out.exists()


class Upsample(torch.nn.Module):
    """interpolate(scale_factor=f, recompute_scale_factor=True) per factor: what torch
    exports with dynamic H/W is Shape -> Gather -> Cast(float) -> Mul(f) -> Cast(float)
    -> Floor -> Unsqueeze -> Concat(h, w) -> Cast(int64) -> Concat -> Resize(sizes), one
    Cast(float) shared by the factors."""

    def __init__(self, factors):
        super().__init__()
        self.factors = factors

    def forward(self, x):
        return tuple(
            torch.nn.functional.interpolate(
                x, scale_factor=factor, mode="nearest", recompute_scale_factor=True
            )
            for factor in self.factors
        )


def test_the_shape_arithmetic_torch_exports_for_interpolate_becomes_integer(tmp_path):
    source = tmp_path / "upsample.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Upsample((2.0, 1.5, 1.1)),
            (torch.rand(1, 3, 8, 12),),
            str(source),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            dynamic_axes={"x": {2: "h", 3: "w"}},
        )
    out = tmp_path / "out.onnx"
    result = fix(source, out, "tensorrt")

    def float_shapes(findings):
        return sorted(f.node for f in findings if f.rule == "float-shape-arithmetic")

    resizes = [n.name for n in onnx.load(source).graph.node if n.op_type == "Resize"]
    assert float_shapes(result.before) == sorted(resizes)
    # 2 and 1.5 (= 3/2: floor(h * 1.5) == (h * 3) div 2) became integers; 1.1 cannot.
    assert float_shapes(result.remaining) == [resizes[2]]
    details = [r.detail for r in result.applied if r.kind == "integer-shape-arithmetic"]
    assert len(details) == 4  # height and width of two factors
    assert sum("Div" in detail for detail in details) == 2  # 1.5: (x * 3) div 2
    for height in range(1, 30):
        for width in (1, 5, 12):
            x = np.random.default_rng(height).random((1, 3, height, width), dtype=np.float32)
            expected, actual = run(str(source), {"x": x}), run(str(out), {"x": x})
            for want, got in zip(expected, actual, strict=True):
                assert want.shape == got.shape and np.array_equal(want, got), (height, width)
