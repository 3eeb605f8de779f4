"""`fix` on a sample of ONNX's node conformance models: it never raises anything but its
one-line FixError, and never breaks a model ONNX Runtime could run."""

from __future__ import annotations

import onnx
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
