"""`fix` on ONNX's node conformance models: on a sample, it never raises anything but its
one-line FixError and never breaks a model ONNX Runtime could run; on chosen ones, it
keeps the inputs, compares unsigned outputs, and skips an opset conversion that would
change the inputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conformance import Case, node_cases, ort_failure

from bladesmith.onnx.fixer import FixError, fix

SAMPLE_EVERY = 30


def test_fix_never_raises_and_never_breaks_a_model_onnxruntime_runs(tmp_path):
    sample = node_cases()[::SAMPLE_EVERY]
    written = 0
    for index, case in enumerate(sample):
        source, out = tmp_path / f"{index}.onnx", tmp_path / f"{index}.fixed.onnx"
        onnx.save(case.model, source)
        try:
            fix(source, out, "ort-cpu")
        except FixError as error:  # one line, and nothing written
            assert "\n" not in str(error) and not out.exists(), case.name
            continue
        written += 1
        if ort_failure(case) is None:
            fixed = Case(case.name, onnx.load(out), case.inputs)
            assert ort_failure(fixed) is None, case.name
    assert written > len(sample) // 2


def _by_name(predicate) -> list[Case]:
    return [case for case in node_cases() if predicate(case.name)]


def _run(model: onnx.ModelProto, inputs) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        info.name: onnx.numpy_helper.to_array(value)
        if isinstance(value, onnx.TensorProto)
        else value
        for info, value in zip(model.graph.input, inputs, strict=True)
    }
    return session.run(None, feeds)


def _fix(case: Case, tmp_path) -> tuple:
    source, out = tmp_path / f"{case.name}.onnx", tmp_path / f"{case.name}.fixed.onnx"
    onnx.save(case.model, source)
    result = fix(source, out, "ort-cpu")
    fixed = onnx.load(out)
    assert [i.name for i in fixed.graph.input] == [i.name for i in case.model.graph.input]
    return result, fixed


def _fixed_equals_original(case: Case, tmp_path) -> None:
    result, fixed = _fix(case, tmp_path)
    assert result.verification.status == "passed", (case.name, result.verification)
    for inputs in case.inputs:  # every input fed, by the original's names
        for expected, actual in zip(_run(case.model, inputs), _run(fixed, inputs), strict=True):
            np.testing.assert_array_equal(actual, expected)


NUMPY_TYPES = ("FLOAT", "FLOAT16", "DOUBLE")


def test_castlike_expanded_keeps_the_input_nothing_reads(tmp_path):
    """The expanded CastLike tests have an input (`like`) whose type alone matters:
    nothing reads it once its reader is folded, and it stays an input. Those with types
    numpy has are verified and run on their own test data, every input fed."""
    cases = _by_name(lambda name: name.startswith("test_castlike") and name.endswith("_expanded"))
    compared = 0
    for case in cases:
        if ort_failure(case) is not None:
            continue
        types = case.name.removeprefix("test_castlike_").removesuffix("_expanded").split("_to_")
        if all(kind in NUMPY_TYPES for kind in types):
            _fixed_equals_original(case, tmp_path)
            compared += 1
        else:  # bfloat16, float8, int4...: kept, but not verifiable through numpy
            _fix(case, tmp_path)
    assert compared == 6


@pytest.mark.parametrize(
    "name",
    [
        "test_add_uint64",
        "test_bitshift_left_uint64",
        "test_bitshift_right_uint64",
        "test_bitwise_and_ui64_bcast_3v1d",
        "test_bitwise_or_ui64_bcast_3v1d",
        "test_bitwise_xor_ui64_bcast_3v1d",
        "test_max_uint64",
        "test_add_uint32",
        "test_add_uint16",
    ],
)
def test_unsigned_outputs_are_compared(name, tmp_path):
    (case,) = _by_name(lambda found: found == name)
    _fixed_equals_original(case, tmp_path)


def test_an_opset_conversion_that_changes_the_inputs_is_skipped_not_claimed(tmp_path):
    """onnx.version_converter turns Scan-8 into Scan-9 by dropping the batch dimension of
    the graph's inputs: the converted model no longer takes the original's inputs."""
    (case,) = _by_name(lambda name: name == "test_scan_sum")
    source, out = tmp_path / "scan.onnx", tmp_path / "scan.fixed.onnx"
    onnx.save(case.model, source)
    result = fix(source, out, "tensorrt")  # TensorRT needs opset 9; the model has 8
    (conversion,) = [r for r in result.applied if r.kind == "opset-conversion"]
    assert conversion.detail.startswith("skipped: it would change the model's interface")
    assert "changed rank" in conversion.detail
    assert result.verification.status == "passed"
    assert [f.rule for f in result.remaining] == ["opset-too-old"]
    (finding,) = result.remaining
    assert "without changing the model's inputs" in finding.hint
