"""Why the CUDA test `test_gpu_passes_on_a_detector` can disagree with its own gate: optimize
the tests' tiny detector on the GPU several times, and print what the gate judged (its
tolerance and verdict) beside what a plain comparison against the model as given finds,
and how far the model as given moves by itself (a second run, TF32 off).

    python benchmarks/probe_detector_gate.py [--runs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bladesmith  # noqa: E402
from bladesmith.config import Config  # noqa: E402
from bladesmith.verify import compare_detections  # noqa: E402
from engine_testing import tiny_detector  # noqa: E402


def summary(comparison) -> dict:
    return {
        "passed": comparison.passed,
        "f1": comparison.f1,
        "strict_f1": comparison.strict_f1,
        "matched": comparison.matched,
        "reference": comparison.reference_count,
        "candidate": comparison.candidate_count,
        "max_score_deviation": comparison.max_score_deviation,
        "max_box_deviation": comparison.max_box_deviation,
        "score_atol": comparison.score_atol,
        "reasons": comparison.reasons,
    }


def eager(model, photos, tf32: bool):
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with torch.no_grad():
            return copy.deepcopy(model).cuda()([p.cuda() for p in photos])
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, photos = tiny_detector()
    expected = eager(model, photos, tf32=True)
    found = {
        "device": torch.cuda.get_device_name(),
        "eager_again": summary(compare_detections(expected, eager(model, photos, True))),
        "eager_tf32_off": summary(compare_detections(expected, eager(model, photos, False))),
        "runs": [],
    }
    print(json.dumps({k: v for k, v in found.items() if k != "runs"}, indent=1), flush=True)
    for _ in range(args.runs):
        optimized, spec, report = bladesmith.optimize(
            model, device="cuda", test_data=[(photos,)], config=Config(warmup=0, iters=2)
        )
        outputs = optimized(photos)
        run = {
            "passes": list(spec.passes),
            "records": [(r.name, r.status, r.reason) for r in report.optimizations],
            "gate": {k: v for k, v in report.accuracy.items() if not isinstance(v, (list, dict))},
            "tolerance": report.tolerance,
            "plain": summary(compare_detections(expected, outputs)),
            "again": summary(compare_detections(outputs, optimized(photos))),
            "vs_tf32_off": summary(compare_detections(eager(model, photos, False), outputs)),
        }
        found["runs"].append(run)
        print(json.dumps(run, indent=1, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1, default=str))


if __name__ == "__main__":
    main()
