"""ONNX's node conformance models, regenerated with onnx's own generator, and ONNX
Runtime's verdict on each: whether its CPU provider loads the model and runs it on the
test's inputs. The ground truth for `check --target ort-cpu` (see test_check_conformance
and benchmarks/bench_check_conformance.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

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


SHIPPED = ("pytorch-converted", "pytorch-operator", "simple")


def shipped_cases() -> list[Case]:
    """The model tests the onnx package ships with their inputs (the folders in
    SHIPPED under onnx/backend/test/data)."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    cases = []
    for folder in SHIPPED:
        for test in sorted((root / folder).iterdir()):
            data_sets = []
            for data_set in sorted(test.glob("test_data_set_*")):
                inputs = sorted(data_set.glob("input_*.pb"), key=lambda p: int(p.stem[6:]))
                data_sets.append(tuple(_read_tensor(path) for path in inputs))
            model = onnx.load(test / "model.onnx")
            cases.append(Case(f"{folder}/{test.name}", model, tuple(data_sets)))
    return cases


def _read_tensor(path: Path) -> onnx.TensorProto:
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return tensor


@dataclass(frozen=True)
class Score:
    """check's errors against ONNX Runtime's failures: a true positive is a model check
    reports errors for and ONNX Runtime cannot run."""

    true_positives: int
    false_positives: int
    false_negatives: int
    true_negatives: int
    false_alarms: tuple[str, ...]
    misses: tuple[str, ...]

    @property
    def precision(self) -> float:
        flagged = self.true_positives + self.false_positives
        return self.true_positives / flagged if flagged else 1.0

    @property
    def recall(self) -> float:
        failing = self.true_positives + self.false_negatives
        return self.true_positives / failing if failing else 1.0

    def __add__(self, other: Score) -> Score:
        return Score(
            self.true_positives + other.true_positives,
            self.false_positives + other.false_positives,
            self.false_negatives + other.false_negatives,
            self.true_negatives + other.true_negatives,
            self.false_alarms + other.false_alarms,
            self.misses + other.misses,
        )

    def summary(self) -> str:
        return (
            f"precision {self.precision:.3f} recall {self.recall:.3f} "
            f"(tp {self.true_positives}, fp {self.false_positives}, "
            f"fn {self.false_negatives}, tn {self.true_negatives})"
        )


def score(cases: list[Case], target: str = "ort-cpu") -> Score:
    """Run check and ONNX Runtime on every case; check must not raise."""
    from bladesmith.onnx.checker import check, has_errors

    counts = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    false_alarms, misses = [], []
    for case in cases:
        flagged = has_errors(check(case.model, target))
        failure = ort_failure(case)
        counts[(flagged, failure is not None)] += 1
        if flagged and failure is None:
            false_alarms.append(case.name)
        elif failure is not None and not flagged:
            misses.append(f"{case.name}: {failure[:160]}")
    return Score(
        counts[(True, True)],
        counts[(True, False)],
        counts[(False, True)],
        counts[(False, False)],
        tuple(false_alarms),
        tuple(misses),
    )


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
