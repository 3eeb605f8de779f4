"""Models bladesmith did not write: torchvision ResNet-50, MobileNetV3-Large and
ViT-B/16 (random weights, 3x224x224), eager against whole-model ``torch.compile``
(default mode) and ``bladesmith.optimize`` (o1), side by side in one run.

    python benchmarks/bench_models.py --device cpu --threads 2      # batch 1
    python benchmarks/bench_models.py --device cuda --json h200.json  # batch 1 and 32

Every row's outputs are compared with eager's at the tolerance bladesmith's report
states (``report.tolerance``), so a speedup never comes from wrong outputs. On the CPU
the three variants of a model are timed in interleaved rounds (``bench_onnx_cpu``'s),
so that load from other processes hits them alike; the rounds in which every run kept
all its cores are reported apart, and the load average is printed with each model.
On a GPU each variant is timed with CUDA events, one after the other.

Targets: on a 2-core CPU, bladesmith at least 1.5x eager for each model; on an H200,
bladesmith ahead of torch.compile at batch 1 and 32, and ResNet-50 at batch 1 at least
5x eager. The ``met`` column says whether each holds; the exit status is 1 when one
does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torchvision

import bladesmith
from bench_onnx_cpu import interleaved
from bladesmith.bench import measure
from bladesmith.verify import compare_outputs

MODELS = ("resnet50", "mobilenet_v3_large", "vit_b_16")
CPU_TARGET = 1.5  # x eager, each model, batch 1, 2 cores
GPU_RESNET_BATCH1_TARGET = 5.0  # x eager


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: best here)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--batches", default=None, help="default: 1 on a CPU, 1,32 on a GPU")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--level", default="o1")
    parser.add_argument("--warmup", type=int, default=None, help="default: CPU 2, GPU 20")
    parser.add_argument("--iters", type=int, default=None, help="default: CPU 10, GPU 100")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    args.models = [name for name in args.models.split(",") if name]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}")
    return args


def variants_for(name: str, batch: int, device, args) -> tuple[dict, dict, torch.Tensor]:
    """(name -> callable, name -> what was built: seconds, passes, tolerance) and the
    input, for one model at one batch size."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    if name == "vit_b_16":  # torchvision zeroes ViT's head: its logits would all be 0
        torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    model.to(device)
    x = torch.randn(batch, 3, 224, 224, device=device)

    def eager():
        with torch.inference_mode():
            return model(x)

    runs, built = {"eager": eager}, {}
    if not args.no_compile:
        compiled = torch.compile(model)
        started = time.perf_counter()
        with torch.no_grad():
            compiled(x)
        built["torch.compile"] = {"build_s": time.perf_counter() - started}

        def compiled_run():
            with torch.no_grad():
                return compiled(x)

        runs["torch.compile"] = compiled_run
    started = time.perf_counter()
    optimized, spec, report = bladesmith.optimize(
        model, args.level, device=device, test_data=[x], config=bladesmith.Config(progress=False)
    )
    built["bladesmith"] = {
        "build_s": time.perf_counter() - started,
        "passes": list(spec.passes),
        "tolerance": report.tolerance,
        "rejected": {
            r.name: r.reason for r in report.optimizations if r.status in ("rejected", "failed")
        },
    }
    runs["bladesmith"] = lambda: optimized(x)
    return runs, built, x


def time_variants(runs: dict, device, args) -> dict:
    """name -> (timing over every round, timing over the undisturbed rounds or None)."""
    if device.type == "cpu":
        variants = {name: (run, None) for name, run in runs.items()}
        return interleaved(variants, args.warmup, args.iters, args.threads)
    return {
        name: (measure(run, warmup=args.warmup, iters=args.iters, device=device), None)
        for name, run in runs.items()
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bladesmith.devices.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    batches = [int(b) for b in (args.batches or ("1,32" if on_gpu else "1")).split(",")]
    args.warmup = args.warmup if args.warmup is not None else (20 if on_gpu else 2)
    args.iters = args.iters if args.iters is not None else (100 if on_gpu else 10)
    torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if on_gpu else f"CPU, {args.threads} threads"
    print(f"{where}; torch {torch.__version__}; level {args.level}", flush=True)
    rows, all_met = [], True
    for name in args.models:
        for batch in batches:
            runs, built, x = variants_for(name, batch, device, args)
            load_before = os.getloadavg()[0]
            timings = time_variants(runs, device, args)
            load_after = os.getloadavg()[0]
            tolerance = built["bladesmith"]["tolerance"]
            reference = runs["eager"]()
            eager_ms = timings["eager"][0].p50_ms
            compile_ms = timings["torch.compile"][0].p50_ms if "torch.compile" in timings else None
            print(
                f"\n{name}, batch {batch} (load average {load_before:.1f} -> {load_after:.1f}"
                f" on {os.cpu_count()} cores); tolerance: {tolerance['why']}"
            )
            for variant, (timing, quiet) in timings.items():
                comparison = compare_outputs(
                    reference, runs[variant](), rtol=tolerance["rtol"], atol=tolerance["atol"]
                )
                row = {
                    "model": name,
                    "batch": batch,
                    "variant": variant,
                    "p50_ms": timing.p50_ms,
                    "undisturbed_p50_ms": quiet.p50_ms if quiet else None,
                    "undisturbed_rounds": quiet.iterations if quiet else 0,
                    "vs_eager": eager_ms / timing.p50_ms,
                    "vs_compile": compile_ms / timing.p50_ms if compile_ms else None,
                    "within_tolerance": comparison.passed,
                    "accuracy": comparison.summary(),
                    "load_average": [load_before, load_after],
                    **built.get(variant, {}),
                }
                if variant == "bladesmith":
                    row["met"] = met(row, on_gpu)
                    all_met = all_met and row["met"]
                rows.append(row)
                print_row(row)
            if built["bladesmith"]["rejected"]:
                print("  bladesmith rejected or failed:")
                for pass_name, reason in built["bladesmith"]["rejected"].items():
                    print(f"    {pass_name}: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all_met else 1


def met(row: dict, on_gpu: bool) -> bool:
    """Whether bladesmith's row meets its target (see the module docstring)."""
    if not row["within_tolerance"]:
        return False
    if not on_gpu:
        return row["vs_eager"] >= CPU_TARGET
    ahead = row["vs_compile"] is None or row["vs_compile"] > 1.0
    if row["model"] == "resnet50" and row["batch"] == 1:
        return ahead and row["vs_eager"] >= GPU_RESNET_BATCH1_TARGET
    return ahead


def print_row(row: dict) -> None:
    quiet = row["undisturbed_p50_ms"]
    parts = [
        f"  {row['variant']:<14} p50 {row['p50_ms']:9.2f} ms",
        f"{row['vs_eager']:5.2f}x eager",
        f"{row['vs_compile']:5.2f}x compile" if row["vs_compile"] else "",
        f"undisturbed p50 {quiet:.2f} ms ({row['undisturbed_rounds']} rounds)" if quiet else "",
        "within tolerance" if row["within_tolerance"] else f"OUT OF TOLERANCE: {row['accuracy']}",
        f"build {row['build_s']:.0f} s" if "build_s" in row else "",
        f"kept {', '.join(row['passes']) or 'nothing'}" if "passes" in row else "",
        f"target {'met' if row['met'] else 'MISSED'}" if "met" in row else "",
    ]
    print("; ".join(part for part in parts if part), flush=True)


if __name__ == "__main__":
    sys.exit(main())
