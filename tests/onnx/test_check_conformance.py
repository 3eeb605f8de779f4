"""`check --target ort-cpu` against ONNX Runtime on ONNX's node conformance tests,
regenerated with onnx's own generator: ONNX Runtime's verdict (load and run each model on
its test inputs) is the truth. The full corpus (the shipped model tests too) is
benchmarks/bench_check_conformance.py."""

from __future__ import annotations

from conformance import node_cases, score


def test_check_agrees_with_onnxruntime_on_onnx_node_tests():
    cases = node_cases()
    assert len(cases) > 1500  # the generator ran, not a stale handful
    result = score(cases, "ort-cpu")  # raises if check raises on any model
    assert result.true_positives + result.false_negatives > 50, result.summary()
    assert result.precision >= 0.95, (result.summary(), result.false_alarms[:20])
    assert result.recall >= 0.90, (result.summary(), result.misses[:20])
