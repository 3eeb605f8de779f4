"""Does a row's answer depend on the rows batched with it? (GPU)

    python benchmarks/probe_serve_batches.py                   # H200, 32 rows of 480x640
    python benchmarks/probe_serve_batches.py --device cpu --rows 4 --size 96x128

``bladesmith loadtest`` checks every served answer against the server's answer for the
same row sent alone (padded to the bucket with zeros). This probe asks the same question
without the server, on the runner the server uses (``serve.signature.BucketRunner``):
32 distinct random rows in one batch, against each row alone in slot 0, and each row
alone in the slot it had in the batch. For the RetinaNet pipeline eager in float32, and
an artifact optimized with fixed_shape, fp16, channels_last and cuda_graph, saved as
``.pt`` and loaded back (what ``bench_serve.py`` serves, without Inductor, to save time).
Per form: rows whose answers differ, and for the first few the detection counts and the
largest score difference.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import bladesmith
from bladesmith.families.retinanet import RetinaNetPipeline
from bladesmith.models import build_retinanet
from bladesmith.passes import registry
from bladesmith.serve.signature import BucketRunner

PASSES = ("fixed_shape", "fp16", "channels_last", "cuda_graph")


def main() -> None:
    from bladesmith.cli.args import input_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=32, help="the batch")
    parser.add_argument("--size", type=input_size, default=(480, 640), metavar="HxW")
    args = parser.parse_args()
    bladesmith.ops.load_library()
    device = torch.device(args.device)
    model = build_retinanet(args.size).to(device).eval()
    rows = np.random.default_rng(0).random((args.rows, 3, *args.size), dtype=np.float32)
    pipeline = RetinaNetPipeline(model, args.size).to(device).eval()
    report("pipeline, float32, eager", lambda batch: run_module(pipeline, batch, device), rows)
    images = torch.from_numpy(rows).to(device)
    passes = [p for p in registry.create_all() if p.name in PASSES]
    optimized, spec, _ = bladesmith.optimize(
        model, device=device, test_data=[(images,)], passes=passes
    )
    print(f"optimized: kept {', '.join(spec.passes)}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        saved = bladesmith.save(optimized, Path(folder) / "rn32.pt")
        runner = BucketRunner(bladesmith.load(saved, trust=True))  # saved just now
    report("optimized .pt, BucketRunner", lambda batch: runner._run_rows([batch]), rows)


def run_module(module, batch: np.ndarray, device) -> list[np.ndarray]:
    with torch.no_grad():
        outputs = module(torch.from_numpy(batch).to(device))
    return [output.cpu().numpy() for output in outputs]


def report(name: str, run, rows: np.ndarray) -> None:
    together = run(rows)
    count = len(rows)
    alone_first, alone_in_place = [], []
    for i in range(count):
        padded = np.zeros_like(rows)
        padded[0] = rows[i]
        alone_first.append([output[0] for output in run(padded)])
        padded = np.zeros_like(rows)
        padded[i] = rows[i]
        alone_in_place.append([output[i] for output in run(padded)])
    for label, alone in (("alone in slot 0", alone_first), ("alone in its slot", alone_in_place)):
        differing = [i for i in range(count) if not same([out[i] for out in together], alone[i])]
        print(f"{name}: {len(differing)} of {count} rows differ from the row {label}", flush=True)
        for i in differing[:3]:
            _, scores, _, detections = (out[i] for out in together)
            print(
                f"  row {i}: {int(detections)} detections batched, {int(alone[i][3])} alone; "
                f"largest score difference {np.abs(scores - alone[i][1]).max():.3g}"
            )


def same(got: list[np.ndarray], expected: list[np.ndarray]) -> bool:
    """loadtest's rule: floats within 1e-4, the rest equal."""
    return all(
        np.allclose(g, e, rtol=1e-4, atol=1e-4)
        if np.issubdtype(e.dtype, np.floating)
        else np.array_equal(g, e)
        for g, e in zip(got, expected)
    )


if __name__ == "__main__":
    main()
