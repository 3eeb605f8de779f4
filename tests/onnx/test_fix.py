"""`fix`: each rewrite on a hand-built model, and the fixed model computes the same
outputs as the original in ONNX Runtime."""

from __future__ import annotations

import importlib

import check_models as models
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bladesmith.errors import BladesmithError
from bladesmith.onnx.fixer import FixError, fix

fix_module = importlib.import_module("bladesmith.onnx.fixer")


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
    assert result.passed
    assert result.verification.status == "skipped"  # dynamic input and no input_shapes

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
    assert [r.kind for r in result.applied] == ["integer-shape-arithmetic"]
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


def test_inexact_float_arithmetic_is_left_alone_and_still_reported(tmp_path):
    result = fix(
        save(models.float_resize_sizes(factor=1.5), tmp_path), tmp_path / "out.onnx", "tensorrt"
    )
    assert not [r for r in result.applied if r.kind == "integer-shape-arithmetic"]
    assert any(f.rule == "float-shape-arithmetic" for f in result.remaining)
    assert not result.passed


def test_opset_is_converted_down_to_the_directml_ceiling(tmp_path):
    out = tmp_path / "out.onnx"
    result = fix(save(models.reduce_mean_opset18(), tmp_path), out, "directml")
    (conversion,) = [r for r in result.applied if r.kind == "opset-conversion"]
    assert "18 -> 17" in conversion.detail
    assert onnx.load(out).opset_import[0].version == 17
    assert result.remaining == []
    assert result.verification.status == "passed"


def test_outputs_that_change_raise_and_write_nothing(tmp_path, monkeypatch):
    def break_model(model, targets, applied):
        model.graph.initializer[0].CopyFrom(models.const("w", np.zeros((4, 3, 3, 3))))
        return model

    monkeypatch.setattr(fix_module, "_convert_opset", break_model)
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
    assert data["passed"] is True
    assert data["applied"][0]["kind"] == "integer-shape-arithmetic"
    assert data["verification"]["status"] == "skipped"
