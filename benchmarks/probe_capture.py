"""Which models a CUDA graph can capture, and what stops it (GPU).

    python benchmarks/probe_capture.py --out $OUT                  # the scripted RetinaNet
    python benchmarks/probe_capture.py --family faster_rcnn mask_rcnn

The model is ``bench_scripted_retinanet.py``'s (bladesmith's fixed-shape RetinaNet
pipeline traced on the GPU, post-processing one custom operator). Each form is captured
in a process of its own, so that one invalidated capture cannot disturb the next:
the trace as loaded (``map_location="cuda"``), ``torch.jit.freeze``d, frozen then
``optimize_for_inference``d (which on CUDA rewrites convolution + ReLU into cuDNN's fused
operators), and frozen by bladesmith (``runtimes.torchscript.freeze``: the scalar
constants the host reads moved back to the CPU). Per form: the operations that
synchronise with the host in one call (``torch.cuda.set_sync_debug_mode("warn")``;
illegal during capture), captured or the first line of the error, whether replayed
outputs equal the uncaptured call's, and the replay's p50.

H200, torch 2.11: the first three forms synchronise 10 times per call (``int()`` of the
head concatenation's shape arithmetic, whose constants the load moved to the GPU) and
cannot be captured.

``--family NAME ...`` does the same for a detector family's fixed-shape pipeline (float32,
480x640, batch 1; names as in ``bench_families.py``), each in a process of its own, with
the Python line of every synchronising operation.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

FORMS = ("traced", "frozen", "optimized", "bladesmith")
SIZE = (480, 640)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--family", nargs="+", help="probe these families' pipelines instead")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "FORM"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.family:
        for name in args.family:
            in_own_process(["family", name], name)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "scripted_retinanet.pt"
    import bladesmith
    from bench_scripted_retinanet import script_retinanet

    bladesmith.ops.load_library()
    script_retinanet(SIZE, model, torch.device("cuda"))
    for form in FORMS:
        in_own_process([str(model), form], form)


def in_own_process(child_args: list[str], label: str) -> None:
    command = [sys.executable, __file__, "--child", *child_args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    print(f"--- {label} (exit {done.returncode})")
    print("\n".join(lines[-25:]), flush=True)


def child(model: str, form: str) -> None:
    import bladesmith
    from bladesmith.runtimes.torchscript import freeze

    bladesmith.ops.load_library()
    device = torch.device("cuda")
    images = torch.rand(1, 3, *SIZE, device=device)
    if model == "family":
        module = family_pipeline(form, device)
    else:
        module = torch.jit.load(model, map_location=device).eval()
        if form in ("frozen", "optimized"):
            module = torch.jit.freeze(module)
        if form == "optimized":
            module = torch.jit.optimize_for_inference(module)
        if form == "bladesmith":
            module = freeze(module, (images,))
    with torch.no_grad():
        expected = [module(images) for _ in range(3)][-1]
        report_synchronisations(module, images)
        graph, captured = capture(module, images)
    if graph is None:
        return
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(captured, expected))
    times = []
    for _ in range(50):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    print(f"captured; replay equals the uncaptured call: {same}; p50 {times[25]:.3f} ms")


def family_pipeline(name: str, device: torch.device):
    from bench_families import BUILDERS
    from bladesmith.families import family_of

    model = BUILDERS[name](SIZE).to(device).eval()
    return family_of(model).adapt(model, SIZE).to(device).eval()


def report_synchronisations(module, images) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        module(images)
        torch.cuda.set_sync_debug_mode("default")
    found = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    print(f"synchronising operations in one call: {len(found)}")
    for where in sorted({f"{w.filename}:{w.lineno}" for w in found})[:10]:
        print(f"  at {where}")


def capture(module, images):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            module(images)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = module(images)
    except RuntimeError as error:
        print(f"capture FAILED: {type(error).__name__}: {str(error).splitlines()[0]}")
        return None, None
    return graph, captured


if __name__ == "__main__":
    main()
