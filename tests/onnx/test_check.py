"""`check`: every rule on a hand-built model, with the node and rule id it must report."""

from __future__ import annotations

import json

import check_models as models
import pytest

from bladesmith.errors import BladesmithError
from bladesmith.onnx.checker import check, has_errors
from bladesmith.onnx.rules.operators import operator_list
from bladesmith.onnx.targets import TARGETS, UnknownTargetError, resolve_targets


def found(findings, rule, target):
    return [f for f in findings if f.rule == rule and f.target == target]


def test_float_sizes_for_resize_are_an_error_for_tensorrt_at_the_resize_node():
    findings = check(models.float_resize_sizes(), ["tensorrt", "ort-cpu"])
    (finding,) = found(findings, "float-shape-arithmetic", "tensorrt")
    assert finding.severity == "error"
    assert finding.node == "resize"
    assert finding.related == ("cast_f", "mul", "round")
    assert "sizes" in finding.message and "Floor" in finding.message
    assert "bladesmith fix" in finding.hint
    assert not found(findings, "float-shape-arithmetic", "ort-cpu")


def test_static_shapes_do_not_hide_float_shape_arithmetic_from_check():
    (finding,) = found(
        check(models.float_resize_sizes(static=True), "tensorrt"),
        "float-shape-arithmetic",
        "tensorrt",
    )
    assert finding.node == "resize"


def test_float_division_into_constant_of_shape_is_found():
    (finding,) = found(
        check(models.half_size_constant_of_shape(), "tensorrt8"),
        "float-shape-arithmetic",
        "tensorrt8",
    )
    assert (finding.node, finding.severity) == ("fill", "error")
    assert finding.related == ("cast_f", "div", "round")


def test_float_arithmetic_made_only_of_shape_layers_is_a_warning():
    (finding,) = found(
        check(models.float_reshape_without_rounding(), "tensorrt"),
        "float-shape-arithmetic",
        "tensorrt",
    )
    assert (finding.node, finding.severity) == ("reshape", "warning")


def test_a_float_graph_input_as_resize_scales_is_an_error():
    (finding,) = found(
        check(models.resize_scales_from_input(), "tensorrt"), "float-shape-arithmetic", "tensorrt"
    )
    assert finding.severity == "error" and "graph input scales" in finding.message


def test_plugin_output_feeding_a_shape_input_is_an_error():
    findings = check(models.plugin_feeds_reshape(), ["tensorrt", "ort-cpu"])
    (shape,) = found(findings, "plugin-shape-input", "tensorrt")
    assert (shape.node, shape.severity, shape.related) == ("reshape", "error", ("plugin",))
    assert "my.plugins::TargetShape" in shape.message
    assert not found(findings, "float-shape-arithmetic", "tensorrt")
    (custom,) = found(findings, "custom-op", "ort-cpu")
    assert custom.node == "plugin" and custom.severity == "warning"
    assert "register_custom_ops_library" in custom.hint
    assert "plugin" in found(findings, "custom-op", "tensorrt")[0].hint.lower()


def test_custom_op_hints_name_what_runs_each_kind_of_node():
    findings = check(models.custom_nodes_of_three_kinds(), ["ort-cpu", "tensorrt"])
    ort = {f.node: f for f in found(findings, "custom-op", "ort-cpu")}
    ours = ort["ours"]
    # onnxruntime-extensions' library alone does not have it (not a registered op)
    assert "onnxruntime_extensions" not in ours.hint and "pip install" not in ours.hint
    assert "only bladesmith.onnx.session runs" in ours.message
    assert "--custom-ops standard" in ours.hint and "custom_ops='standard'" in ours.hint
    assert "get_library_path()" in ort["extensions"].hint
    assert "onnxruntime_extensions" not in ort["plugin"].hint
    trt = {f.node: f for f in found(findings, "custom-op", "tensorrt")}
    assert "--custom-ops standard" in trt["ours"].hint and "plugin" in trt["plugin"].hint
    assert all("\n" not in f.message + f.hint for f in findings)


def test_opset_above_directml_ceiling_is_a_warning_and_above_tensorrt_an_error():
    findings = check(models.reduce_mean(21), ["directml", "tensorrt", "ort-cpu"])
    (finding,) = found(findings, "opset-too-new", "directml")
    assert finding.severity == "warning" and "opset 21" in finding.message
    assert "up to 20" in finding.message and "slowly" in finding.message
    assert "DirectML-ExecutionProvider" in finding.source
    assert not found(findings, "opset-too-new", "tensorrt")
    assert not found(findings, "opset-too-new", "ort-cpu")
    assert not found(check(models.reduce_mean(20), "directml"), "opset-too-new", "directml")
    (trt,) = found(check(models.reduce_mean(25), "tensorrt"), "opset-too-new", "tensorrt")
    assert trt.severity == "error" and "up to 24" in trt.message


def test_opset_below_tensorrt_floor():
    (finding,) = found(check(models.relu(opset=8), "tensorrt"), "opset-too-old", "tensorrt")
    assert "needs 9" in finding.message


def test_unsupported_operator_names_node_and_source():
    findings = check(models.unique(), ["tensorrt", "ort-cuda", "ort-cpu"])
    (trt,) = found(findings, "unsupported-op", "tensorrt")
    assert (trt.node, trt.severity) == ("unique", "error")
    assert "onnx-tensorrt" in trt.source
    (cuda,) = found(findings, "unsupported-op", "ort-cuda")
    assert cuda.severity == "warning" and "CPU" in cuda.message  # CPU fallback
    assert "OperatorKernels.md" in cuda.source and "operator_support.json" in cuda.source
    assert not found(findings, "unsupported-op", "ort-cpu")


def test_cpu_operator_list_comes_from_the_installed_onnxruntime():
    cpu = operator_list("CPUExecutionProvider")
    assert "installed onnxruntime" in cpu.source
    assert cpu.supports("", "Relu", 14)
    assert not cpu.supports("", "NoSuchOp", 1)
    assert operator_list("DmlExecutionProvider").supports("", "Resize", 13)


def test_dynamic_dimensions_matter_to_directml_and_tensorrt_only():
    findings = check(models.relu(static=False), "all")
    assert found(findings, "dynamic-dim", "directml")[0].severity == "warning"
    assert found(findings, "dynamic-dim", "tensorrt")[0].severity == "info"
    assert "'x'" in found(findings, "dynamic-dim", "tensorrt")[0].message
    assert not found(findings, "dynamic-dim", "ort-cpu")


def test_int64_narrowing_for_tensorrt8():
    findings = check(models.int64_arithmetic(), ["tensorrt8", "tensorrt"])
    narrowed = found(findings, "int64-narrowed", "tensorrt8")
    constants = [f for f in narrowed if f.severity == "warning"]
    assert [f.node for f in constants] == ["add"]  # Slice's INT64_MAX end is safe to clamp
    assert {f.severity for f in narrowed} == {"warning", "info"}
    assert not found(findings, "int64-narrowed", "tensorrt")


def test_zero_size_dimensions():
    findings = check(models.empty_tensor(), ["tensorrt", "ort-cpu"])
    assert {f.node for f in found(findings, "zero-size-dim", "tensorrt")} == {None, "relu"}
    assert not found(findings, "zero-size-dim", "ort-cpu")
    (data_dependent,) = found(check(models.unique(), "directml"), "zero-size-dim", "directml")
    assert data_dependent.node == "unique"


def test_empty_placeholders_and_the_shape_of_a_scalar_are_not_empty_data():
    findings = check(models.empty_placeholders(), ["tensorrt", "tensorrt8", "directml"])
    assert not [f for f in findings if f.rule == "zero-size-dim"]
    (sliced,) = found(check(models.sliced_empty(), "directml"), "zero-size-dim", "directml")
    assert sliced.node == "slice" and "'y' has shape [0]" in sliced.message


def test_shape_and_zero_size_rules_read_if_and_loop_bodies():
    (flow,) = found(
        check(models.float_reshape_in_if(), "tensorrt"), "float-shape-arithmetic", "tensorrt"
    )
    assert (flow.node, flow.severity, flow.related) == ("reshape", "error", ("cast_f", "floor"))
    (zero,) = found(check(models.nonzero_in_loop(), "directml"), "zero-size-dim", "directml")
    assert zero.node == "nonzero" and "NonZero" in zero.message


def test_a_clean_model_has_no_findings_and_findings_serialise(tmp_path):
    import onnx

    path = tmp_path / "relu.onnx"
    onnx.save(models.relu(), path)
    assert check(path, "all") == []
    findings = check(models.float_resize_sizes(), "all")
    assert has_errors(findings)
    decoded = json.loads(json.dumps([f.to_dict() for f in findings]))
    assert decoded[0]["rule"] == "float-shape-arithmetic" and decoded[0]["related"]


def test_errors_come_first_within_a_target():
    findings = check(models.float_resize_sizes(), "tensorrt")
    assert [f.severity for f in findings] == ["error", "info"]


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(UnknownTargetError, match="tensorrt, tensorrt8, directml"):
        check(models.relu(), "tensorrt9")
    with pytest.raises(BladesmithError, match="missing.onnx.: no such file"):
        check(tmp_path / "missing.onnx", "tensorrt")
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(BladesmithError, match="not a readable ONNX model"):
        check(tmp_path / "bad.onnx", "tensorrt")


def test_targets_resolve_from_names_lists_and_all():
    assert [t.name for t in resolve_targets("tensorrt,directml")] == ["tensorrt", "directml"]
    assert len(resolve_targets("all")) == len(TARGETS)
    assert TARGETS["directml"].session_options == {
        "enable_mem_pattern": False,
        "execution_mode": "sequential",
    }
