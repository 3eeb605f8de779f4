"""How far `bladesmith check --target ort-cpu` agrees with ONNX Runtime on the whole
conformance corpus: ONNX's node tests regenerated with onnx's generator, plus the
pytorch-converted, pytorch-operator and simple model tests the onnx package ships.
ONNX Runtime's verdict (its CPU provider loads the model and runs it on the test inputs)
is the truth; a model check reports errors for counts as flagged.

    PYTHONPATH=src:tests/onnx python benchmarks/bench_check_conformance.py [--list]
"""

from __future__ import annotations

import argparse
import platform
import time

import onnx
import onnxruntime
from conformance import node_cases, score, shipped_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every false alarm and miss")
    args = parser.parse_args()
    start = time.perf_counter()
    corpora = {"node (generated)": node_cases(), "shipped model tests": shipped_cases()}
    print(
        f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"{platform.machine()} {platform.system()}"
    )
    results = []
    for name, cases in corpora.items():
        results.append(score(cases))
        print(f"{name}: {len(cases)} models, {results[-1].summary()}")
    result = sum(results[1:], results[0])
    print(f"all: {sum(map(len, corpora.values()))} models, {result.summary()}")
    for name in result.false_alarms if args.list else result.false_alarms[:10]:
        print(f"  false alarm: {name}")
    for line in result.misses if args.list else result.misses[:20]:
        print(f"  miss: {line}")
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
