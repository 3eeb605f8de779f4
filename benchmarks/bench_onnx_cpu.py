"""RetinaNet on the CPU: torchvision eager against the exported model in ONNX Runtime.

    .venv/bin/python benchmarks/bench_onnx_cpu.py [--image-size 480x640] [--threads N]

Rows: torchvision eager (the baseline); bladesmith's export with the operators as
custom nodes ("domain") and lowered to standard ONNX ("standard"); and, for reference,
torch's plain TorchScript-based export of the unmodified torchvision model. Every row
runs the same photographs; F1 compares its detections with eager's. The variants are
timed in interleaved rounds, so that load from other processes hits them alike, and the
rounds in which every run kept all its cores are reported apart: on a shared machine
they are what the model costs, and the rest is what the neighbours cost.
Random weights (nothing is downloaded), calibrated so that post-processing works as
hard as a trained model's on a busy image.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bladesmith.bench import METHOD_PERF_COUNTER, Timing, measure
from bladesmith.families.retinanet import RetinaNetPipeline
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet
from bladesmith.onnx import export, session
from bladesmith.verify import compare_detections

OUTPUT_NAMES = ["boxes", "scores", "labels", "num_detections"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-size", default="480x640", help="HxW (default 480x640)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch and ONNX Runtime intra-op threads (default: the cores this process may use)",
    )
    parser.add_argument("--backbone", default="resnet50", choices=("resnet50", "resnet18"))
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds")
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument(
        "--modes",
        default="domain,standard",
        help="bladesmith export modes to run, comma-separated (default domain,standard)",
    )
    parser.add_argument("--no-plain", action="store_true", help="skip the plain export row")
    args = parser.parse_args(argv)
    args.image_size = tuple(int(s) for s in args.image_size.lower().split("x"))
    args.modes = [mode for mode in args.modes.split(",") if mode]
    return args


def padded_to_list(outputs):
    boxes, scores, labels, counts = outputs
    return [
        {"boxes": boxes[i, :n], "scores": scores[i, :n], "labels": labels[i, :n]}
        for i, n in enumerate(counts.tolist())
    ]


def triples_to_list(outputs):
    # torchvision's exported detector: boxes, scores, labels for each image in turn.
    return [
        {"boxes": b, "scores": s, "labels": c}
        for b, s, c in zip(outputs[0::3], outputs[1::3], outputs[2::3], strict=True)
    ]


def plain_export(model, images, path, opset):
    """torch's own export of the unmodified torchvision model, as users do it today."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (list(images),), str(path), dynamo=False, opset_version=opset)
    return path


def interleaved(variants, warmup, iters, threads):
    """Per variant, a Timing over all ``iters`` rounds and one over the undisturbed rounds
    (None if there was none); each round runs every variant once.

    A round is undisturbed when every run in it kept ``threads`` cores busy: its process
    CPU time is at least 90% of ``threads`` x its wall time. On a shared machine other
    processes take cores away from some runs, and that hurts the variants unequally.
    """
    for _ in range(warmup):
        for run, _ in variants.values():
            run()
    rounds = []
    for _ in range(iters):
        round_ = {}
        for name, (run, _) in variants.items():
            before = os.times()
            wall_ms = measure(run, warmup=0, iters=1).mean_ms
            after = os.times()
            cpu_ms = 1000.0 * (after.user - before.user + after.system - before.system)
            round_[name] = (wall_ms, cpu_ms >= 0.9 * threads * wall_ms)
        rounds.append(round_)
    undisturbed = [r for r in rounds if all(busy for _, busy in r.values())]

    def timing(selected, name):
        if not selected:
            return None
        samples = [r[name][0] for r in selected]
        return Timing.from_samples(samples, warmup=warmup, method=METHOD_PERF_COUNTER, device="cpu")

    return {name: (timing(rounds, name), timing(undisturbed, name)) for name in variants}


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 110)  # no wrapping in logs
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = build_retinanet(args.image_size, backbone=args.backbone)
    pipeline = RetinaNetPipeline(model, args.image_size).eval()
    images = sample_images(args.batch, args.image_size)
    candidates = pipeline.candidates_per_level(images)
    with torch.inference_mode():
        reference = model(list(images))

    def eager():
        with torch.inference_mode():
            return model(list(images))

    # name -> (timed call, its outputs as detection lists)
    variants = {"torchvision eager": (eager, lambda out: out)}
    with tempfile.TemporaryDirectory() as workdir:
        for mode in args.modes:
            path = export(
                pipeline,
                images,
                Path(workdir) / f"retinanet_{mode}.onnx",
                opset=args.opset,
                custom_ops=mode,
                input_names=["images"],
                output_names=OUTPUT_NAMES,
            )
            ort_session = session(path, device="cpu", threads=args.threads)
            variants[f"ORT {mode}"] = (
                lambda s=ort_session: s(images),
                padded_to_list,
            )
        if not args.no_plain:
            path = plain_export(model, images, Path(workdir) / "plain.onnx", args.opset)
            plain = session(path, device="cpu", threads=args.threads)
            variants["ORT plain export"] = (
                lambda: plain(*images),
                triples_to_list,
            )
        console.print(
            f"RetinaNet {args.backbone}-FPN, {args.batch} x {args.image_size[0]}x"
            f"{args.image_size[1]}, candidates over the threshold per level (fewest over "
            f"the batch): {candidates}; {args.threads} threads; set-up "
            f"{time.perf_counter() - started:.0f} s; timing {args.warmup} + {args.iters} "
            "interleaved rounds..."
        )
        timings = interleaved(variants, args.warmup, args.iters, args.threads)
        accuracy = {
            name: compare_detections(reference, to_list(run()))
            for name, (run, to_list) in variants.items()
        }

    baseline, quiet_baseline = timings["torchvision eager"]
    quiet_rounds = 0 if quiet_baseline is None else quiet_baseline.iterations
    table = Table(title="RetinaNet on the CPU: latency per batch (ms) and detections vs eager")
    columns = ("variant", "p50", "p90", "min", "speedup p50", "undisturbed p50", "F1")
    for column in (*columns, "max box dev"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, (timing, quiet) in timings.items():
        comparison = accuracy[name]
        deviation = comparison.max_box_deviation
        table.add_row(
            name,
            f"{timing.p50_ms:.1f}",
            f"{timing.p90_ms:.1f}",
            f"{timing.min_ms:.1f}",
            f"{baseline.p50_ms / timing.p50_ms:.2f}x",
            "-"
            if quiet is None
            else f"{quiet.p50_ms:.1f} ({quiet_baseline.p50_ms / quiet.p50_ms:.2f}x)",
            f"{comparison.f1:.4f}",
            "-" if deviation is None else f"{deviation:.1e} px",
        )
    console.print(table)
    console.print(
        f"{quiet_rounds} of {args.iters} rounds were undisturbed (every run kept "
        f"{args.threads} cores busy); 'undisturbed p50' and its speedup come from those."
    )
    return 0 if all(comparison.passed for comparison in accuracy.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
