"""Every torchvision detector family end to end: eager vs torch.compile vs bladesmith.

    python benchmarks/bench_families.py --json families.json              # GPU, batch 1 and 32
    python benchmarks/bench_families.py --device cpu --threads 2 --batches 1 \\
        --input-size 160x224 --families fcos ssdlite faster_rcnn_mobilenet

Per family and batch, side by side in one run: torchvision eager float32, whole-model
``torch.compile`` (GPU, or ``--compile-cpu``), the family's fixed-shape pipeline run
eagerly (``pipeline``), and ``bladesmith.optimize`` at ``--level``. Models have random
weights calibrated to a trained model's post-processing load (each family module's
builder) and see real photographs; SSD runs at its own size (it resizes every image).
Detections are compared with eager float32's by F1 as optimize's gate defines it
(near ties and rounding flips excused) and strictly. Where rounding flips had to be
excused, the ``noise floor`` column is the lowest F1 of eager float32 itself with its
weights moved by float32 rounding (two runs, each against the model): a random-weight
R-CNN is chaotic, and the gate then judges passes at that floor. On a CPU the rows are timed in
interleaved rounds, each round running every row once (``bench_onnx_cpu``'s), and the
rounds in which every run kept its cores busy are reported apart: timed one after
another on two shared cores, the rows disagreed with the engine's own figure by 10-30%.

Targets (H200, 3x480x640, batch 1): optimized >= 8x eager and >= 4x torch.compile at
F1 >= 0.99 for every family. CPU (2 cores): >= 1.5x eager.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import bladesmith
from bench_onnx_cpu import interleaved
from bench_optimize import Timer, device_name, relate
from bladesmith.families import family_of
from bladesmith.families.fcos import build_fcos
from bladesmith.families.rcnn import build_rcnn
from bladesmith.families.ssd import build_ssd
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet

BUILDERS = {
    "retinanet": lambda size: build_retinanet(size),
    "retinanet_v2": lambda size: build_retinanet(size, backbone="resnet50_v2"),
    "fcos": lambda size: build_fcos(size),
    "ssd300": lambda size: build_ssd("ssd300_vgg16"),
    "ssdlite": lambda size: build_ssd("ssdlite320_mobilenet_v3_large"),
    "faster_rcnn": lambda size: build_rcnn("fasterrcnn_resnet50_fpn", size),
    "faster_rcnn_v2": lambda size: build_rcnn("fasterrcnn_resnet50_fpn_v2", size),
    "faster_rcnn_mobilenet": lambda size: build_rcnn("fasterrcnn_mobilenet_v3_large_fpn", size),
    "mask_rcnn": lambda size: build_rcnn("maskrcnn_resnet50_fpn", size),
}
NATIVE_SIZE = {"ssd300": (300, 300), "ssdlite": (320, 320)}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = bladesmith.devices.resolve_device(args.device)
    rows = []
    for name in args.families:
        size = NATIVE_SIZE.get(name, args.input_size)
        model = BUILDERS[name](size).to(device)
        family = family_of(model)
        for batch in args.batches:
            rows += bench(name, model, family, size, batch, device, args)
        del model
    print_table(rows, device)
    if args.json:
        data = {"device": device_name(device), "rows": rows}
        Path(args.json).write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")


def bench(name, model, family, size, batch, device, args) -> list[dict]:
    images = list(sample_images(batch, size, device=device))
    warmup, iters = (args.warmup, args.iters) if batch == 1 else (args.warmup // 2, args.iters // 4)
    with torch.no_grad():
        reference = model(images)
    on_cpu = device.type == "cpu"  # timed again below, interleaved: one run here
    timed = Timer(0 if on_cpu else warmup, 1 if on_cpu else max(iters, 1), device, batch, model)
    found = [timed("eager fp32", model, images, reference)]
    runs = [model]
    if device.type == "cuda" or args.compile_cpu:
        compiled = torch.compile(model, dynamic=False)
        found.append(timed("torch.compile", compiled, images, reference, build=True))
        runs.append(compiled)
    pipeline = family.user_form(family.adapt(model, size).to(device))
    found.append(timed("pipeline", pipeline, images, reference))
    runs.append(pipeline)
    started = time.perf_counter()
    optimized, spec, _ = bladesmith.optimize(
        model,
        level=args.level,
        device=device,
        test_data=[(images,)],
        config=bladesmith.Config(warmup=warmup, iters=max(iters, 1)),
    )
    found.append(timed(f"bladesmith {args.level}", optimized, images, reference))
    found[-1]["build_s"] = time.perf_counter() - started
    found[-1]["passes"] = list(spec.passes)
    runs.append(optimized)
    if on_cpu:
        retime_interleaved(found, runs, images, warmup, max(iters, 1), batch)
    relate(found)
    for row in found:
        row["family"] = name
    return found


def retime_interleaved(rows, runs, images, warmup, iters, batch) -> None:
    """The rows' timings from interleaved rounds; ``undisturbed``: over the rounds in
    which every run kept all its cores busy (None when none did)."""
    variants = {row["name"]: ((lambda run=run: run(images)), None) for row, run in zip(rows, runs)}
    with torch.no_grad():
        timings = interleaved(variants, warmup, iters, torch.get_num_threads())
    for row in rows:
        every, undisturbed = timings[row["name"]]
        row["timing"] = every.to_dict()
        row["timing"]["throughput"] = batch * 1000.0 / every.p50_ms  # images, not calls
        row["undisturbed"] = undisturbed.to_dict() if undisturbed else None


def print_table(rows, device) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Detector families, realistic load, on {device_name(device)}")
    columns = ("Family", "Variant", "Batch", "p50 ms", "Images/s", "vs eager", "vs compile")
    for column in (*columns, "F1", "strict F1", "noise floor"):
        table.add_column(column, justify="left" if column in ("Family", "Variant") else "right")
    for row in rows:
        timing = row["timing"]
        table.add_row(
            row["family"],
            row["name"],
            str(row["batch"]),
            f"{timing['p50_ms']:.2f}",
            f"{timing['throughput']:.1f}",
            f"{row['vs_eager']:.2f}x",
            f"{row['vs_compile']:.2f}x" if "vs_compile" in row else "-",
            f"{row['f1']:.4f}" if "f1" in row else "-",
            f"{row['strict_f1']:.4f}" if "strict_f1" in row else "-",
            f"{row['noise_floor_f1']:.4f}" if "noise_floor_f1" in row else "-",
        )
    console = Console(width=170)
    console.print(table)
    for row in rows:
        if "passes" in row:
            kept = ", ".join(row["passes"])
            console.print(f"{row['family']}, batch {row['batch']}: kept {kept}")
    for row in rows:
        if row.get("undisturbed"):
            quiet = row["undisturbed"]
            console.print(
                f"{row['family']}, {row['name']}: {quiet['p50_ms']:.2f} ms p50 over the "
                f"{quiet['iterations']} undisturbed rounds"
            )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--families", nargs="+", choices=list(BUILDERS), default=list(BUILDERS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-size", type=parse_size, default=(480, 640))
    parser.add_argument("--level", default="o1", choices=["o0", "o1", "o2"])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--compile-cpu", action="store_true", help="time torch.compile on CPU")
    parser.add_argument("--json", help="write the rows to this file")
    return parser.parse_args()


def parse_size(text: str) -> tuple[int, int]:
    height, width = text.lower().split("x")
    return int(height), int(width)


if __name__ == "__main__":
    main()
