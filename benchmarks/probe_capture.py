"""Which form of a traced TorchScript RetinaNet a CUDA graph can capture (GPU).

    python benchmarks/probe_capture.py --out $OUT

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "FORM"))
    args = parser.parse_args()
    if args.child:
        model, form = args.child
        child(Path(model), form)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "scripted_retinanet.pt"
    import bladesmith
    from bench_scripted_retinanet import script_retinanet

    bladesmith.ops.load_library()
    script_retinanet((480, 640), model, torch.device("cuda"))
    for form in FORMS:
        command = [sys.executable, __file__, "--child", str(model), form]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240)
        lines = (done.stdout + done.stderr).strip().splitlines()
        print(f"--- {form} (exit {done.returncode})")
        print("\n".join(lines[-25:]), flush=True)


def child(model_file: Path, form: str) -> None:
    import bladesmith
    from bladesmith.runtimes.torchscript import freeze

    bladesmith.ops.load_library()
    device = torch.device("cuda")
    module = torch.jit.load(str(model_file), map_location=device).eval()
    images = torch.rand(1, 3, 480, 640, device=device)
    if form in ("frozen", "optimized"):
        module = torch.jit.freeze(module)
    if form == "optimized":
        module = torch.jit.optimize_for_inference(module)
    if form == "bladesmith":
        module = freeze(module, (images,))
    with torch.no_grad():
        expected = [module(images) for _ in range(3)][-1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            module(images)
            torch.cuda.set_sync_debug_mode("default")
        synchronising = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
        print(f"synchronising operations in one call: {len(synchronising)}")
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


if __name__ == "__main__":
    main()
