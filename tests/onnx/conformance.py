"""ONNX's node conformance models, regenerated with onnx's own generator, and ONNX
Runtime's verdict on each: whether its CPU provider loads the model and runs it on the
test's inputs. The ground truth for `check --target ort-cpu` (see test_check_conformance
and benchmarks/bench_check_conformance.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort


@dataclass(frozen=True)
class Case:
    name: str
    model: onnx.ModelProto
    inputs: tuple  # one tuple of input values per data set


def node_cases() -> list[Case]:
    """Every node test ONNX's generator knows (what `backend-test-tools generate-data`
    writes to onnx/backend/test/data/node), built in memory."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = node.collect_testcases(None)
    return [
        Case(case.name, case.model, tuple(tuple(inputs) for inputs, _ in case.data_sets or ()))
        for case in cases
        if case.model is not None
    ]


def ort_failure(case: Case) -> str | None:
    """Why ONNX Runtime's CPU provider cannot load or run the case, or None when it can.
    Inputs its Python binding cannot build (float8, int4, bfloat16 tensors) leave the
    verdict to loading, where ONNX Runtime picks its kernels."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(
            case.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        accepted = {entry.name for entry in session.get_inputs()}
        for inputs in case.inputs:
            feeds = {
                info.name: _ort_value(value, info.type)
                for info, value in zip(case.model.graph.input, inputs, strict=False)
                if info.name in accepted
            }
            try:
                session.run(None, feeds)
            except RuntimeError as error:  # building the inputs or returning the outputs
                if not str(error).startswith(_NO_NUMPY_TYPE):
                    raise
    except Exception as error:  # onnxruntime raises its own Fail/NotImplemented types
        return str(error).splitlines()[0]
    return None


def _ort_value(value, type_proto: onnx.TypeProto):
    """A test input as ONNX Runtime's Python binding takes it: arrays, lists of arrays
    for sequences, OrtValues for element types numpy lacks (bfloat16, float8, int4)."""
    if isinstance(value, onnx.TensorProto):
        value = onnx.numpy_helper.to_array(value)
    if isinstance(value, list):
        element = type_proto.sequence_type.elem_type
        return [_ort_value(item, element) for item in value]
    if value is None or type_proto.HasField("optional_type"):
        return value
    value = np.asarray(value)
    elem_type = type_proto.tensor_type.elem_type
    if elem_type and value.dtype.kind == "V" or value.dtype.name in _ML_DTYPES:
        raw = np.ascontiguousarray(value).view(np.uint8 if value.itemsize == 1 else np.uint16)
        try:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, elem_type)
        except RuntimeError as error:
            if not str(error).startswith(_NO_NUMPY_TYPE):
                raise
            return value  # run() raises the same error, which means "loaded"
    return value


_NO_NUMPY_TYPE = "No corresponding Numpy type"
_ML_DTYPES = frozenset(
    {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
     "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4", "int2", "uint2"}
)  # fmt: skip
