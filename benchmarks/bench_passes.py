"""Combinations of optimize's passes, composed by hand without the accuracy gate: the
latency and the F1 of each, side by side, to see what the gate's choices cost.

    python benchmarks/bench_passes.py                                  # GPU, default combos
    python benchmarks/bench_passes.py --batches 32 --combos adapter,fp16,cuda_graph
    python benchmarks/bench_passes.py --device cpu --threads 2 --combos adapter,torchscript
    python benchmarks/bench_passes.py --batches 1 --profile --top 30   # and each combo's kernels

Each combo is a comma-separated list of pass names, applied in that order ("adapter"
is short for fixed_shape). The model is the realistic-load RetinaNet R50-FPN of
bench_optimize.py on real photographs; every row is timed on the same images and its
detections are compared with eager float32's: F1 with near ties and rounding flips
excused (what optimize's gate uses) and strict F1 (every unmatched detection counts).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

import bladesmith
from bench_optimize import Timer
from bladesmith.artifact import OptimizedModule
from bladesmith.config import Config
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet
from bladesmith.passes import Candidate, Context
from bladesmith.passes.registry import create_all

GPU_COMBOS = (
    "adapter,cuda_graph",
    "adapter,fp16,channels_last,cuda_graph",
    "adapter,head_packing,fp16,channels_last,cuda_graph",
    "adapter,fp16,channels_last,inductor,cuda_graph",
    "adapter,fp16,channels_last,conv_fusion,inductor,cuda_graph",
    "adapter,head_packing,fp16,channels_last,inductor,cuda_graph",
    "adapter,head_packing,fp16,inductor,cuda_graph",
    "adapter,head_packing,channels_last,inductor,cuda_graph",
)
CPU_COMBOS = ("adapter", "adapter,torchscript", "adapter,onnxruntime")
ALIASES = {"adapter": "fixed_shape"}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = bladesmith.devices.resolve_device(args.device)
    passes = {p.name: p for p in create_all()}
    model = build_retinanet(args.input_size).to(device).eval()
    rows = []
    for batch in args.batches:
        images = list(sample_images(batch, args.input_size, device=device))
        with torch.no_grad():
            reference = model(images)
        warmup, iters = (args.warmup, args.iters) if batch == 1 else (3, args.iters // 4 or 1)
        timed = Timer(warmup, iters, device, batch, model)
        rows.append(timed("eager fp32", model, images, reference))
        for combo in args.combos:
            names = [ALIASES.get(n, n) for n in combo.split(",")]
            context = Context(
                device=device,
                level=args.level,
                config=Config(),
                example_args=(images,),
                test_args=[(images,)],
            )
            started = time.perf_counter()
            try:
                candidate = Candidate(module=model, device=device)
                for name in names:
                    candidate = passes[name].apply(candidate, context)
                    context.kept.append(name)
                module = OptimizedModule.from_candidate(candidate)
                row = timed(combo, module, images, reference)
                print(f"  {row['accuracy']}", flush=True)
                if args.profile and device.type == "cuda":
                    row["kernels_us"] = print_kernels(module, images, args.top)
            except Exception as error:  # one failing combo must not hide the others
                row = {"name": combo, "batch": batch, "error": f"{type(error).__name__}: {error}"}
                print(f"{combo}, batch {batch}: FAILED {row['error'][:300]}", flush=True)
            row["build_s"] = time.perf_counter() - started
            rows.append(row)
            del context, candidate
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")


def print_kernels(module, images, top: int) -> dict[str, float]:
    """Device time per call of the kernels ``module`` launches: the total and the largest."""
    from gpu_probe import kernel_times

    with torch.no_grad():
        times = kernel_times(lambda: module(images), runs=20)
    print(f"  kernels: {len(times)} names, {sum(times.values()):.1f} us of device time per call")
    for name, us in list(times.items())[:top]:
        print(f"    {us:9.1f} us  {name[:90]}")
    return times


def print_table(rows: list[dict]) -> None:
    eager = {r["batch"]: r["timing"]["p50_ms"] for r in rows if r["name"] == "eager fp32"}
    header = f"{'combo':<52} {'batch':>5} {'p50 ms':>9} {'img/s':>7} {'vs eager':>8} "
    header += f"{'F1':>7} {'strict':>7} {'max score dev':>13} {'build s':>8}"
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<52} {r['batch']:>5} FAILED: {r['error'][:80]}")
            continue
        dev, p50 = r["max_score_deviation"], r["timing"]["p50_ms"]
        print(
            f"{r['name']:<52} {r['batch']:>5} {p50:>9.3f} {r['timing']['throughput']:>7.0f} "
            f"{eager[r['batch']] / p50:>7.2f}x {r['f1']:>7.4f} {r['strict_f1']:>7.4f} "
            f"{'-' if dev is None else format(dev, '.2e'):>13} "
            f"{r.get('build_s', 0):>8.1f}"
        )


def parse_args() -> argparse.Namespace:
    from bladesmith.cli.args import input_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--level", default="o1", choices=("o0", "o1", "o2"))
    parser.add_argument("--input-size", type=input_size, default=(480, 640), metavar="HxW")
    parser.add_argument("--batches", type=lambda t: [int(b) for b in t.split(",")], default=None)
    parser.add_argument("--combos", nargs="+", default=None, help="pass lists, e.g. adapter,fp16")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--profile", action="store_true", help="CUDA: device time per kernel")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per combo")
    parser.add_argument("--json")
    args = parser.parse_args()
    on_gpu = bladesmith.devices.resolve_device(args.device).type == "cuda"
    args.batches = args.batches or ([1, 32] if on_gpu else [1])
    args.combos = args.combos or list(GPU_COMBOS if on_gpu else CPU_COMBOS)
    return args


if __name__ == "__main__":
    main()
