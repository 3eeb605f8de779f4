"""RetinaNet R50-FPN end to end: torchvision eager vs torch.compile vs bladesmith.optimize.

    python benchmarks/bench_optimize.py --json bench.json                  # GPU, batch 1 and 32
    python benchmarks/bench_optimize.py --device cpu --threads 2 --batches 1

Every row maps images already on the device to detections (torchvision's list of dicts;
"padded" rows return the fixed-shape tensors instead). The model has random weights
calibrated to a trained model's post-processing load (``build_retinanet(realistic_load=
True)``) and sees real photographs. Detections are compared with eager float32's:
F1 over matches of the same class at IoU >= 0.9, with near ties and what rounding noise
alone flips in the model excused (what optimize's gate uses) and strict (every unmatched
detection counts). On a GPU a row runs eager
float32 with TF32 off: its F1 against the default (TF32) eager is the noise floor of the
others. Prints one table; ``--json`` writes
the rows, the optimize reports and the versions.

Targets (H200, 3x480x640): batch 1 optimized >= 10x eager and >= 8x torch.compile at
F1 >= 0.99; batch 32 >= 3,000 images/s. CPU (2 cores): optimized >= 1.8x eager.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import bladesmith
from bladesmith.bench import measure
from bladesmith.engine.reference import reference_under_noise
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet
from bladesmith.verify import compare_detections


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = bladesmith.devices.resolve_device(args.device)
    model = build_retinanet(args.input_size, weights=args.weights).to(device)
    rows, reports = [], {}
    for batch in args.batches:
        images = list(sample_images(batch, args.input_size, device=device))
        warmup, iters = (
            (args.warmup, args.iters) if batch == 1 else (args.warmup_large, args.iters_large)
        )
        with torch.no_grad():
            reference = model(images)
        timed = Timer(warmup, iters, device, batch, model)
        found = [timed("eager fp32", model, images, reference)]
        if device.type == "cuda":
            # cuDNN runs float32 convolutions in TF32 by default, the baseline included:
            # how far true float32 lies from it is the noise floor of every F1 below.
            found.append(timed("eager fp32, TF32 off", without_tf32(model), images, reference))
        if device.type == "cuda" or args.compile_cpu:
            compiled = torch.compile(model, dynamic=False)
            found.append(timed("torch.compile", compiled, images, reference, build=True))
        started = time.perf_counter()
        optimized, spec, report = bladesmith.optimize(
            model,
            level=args.level,
            device=device,
            test_data=[(images,)],
            config=bladesmith.Config(warmup=warmup, iters=iters, progress=True),
        )
        built_s = time.perf_counter() - started
        found.append(timed(f"bladesmith {args.level}", optimized, images, reference))
        found[-1]["build_s"] = built_s
        found[-1]["passes"] = list(spec.passes)
        if spec.output == "detections":
            padded = optimized.as_padded()
            found.append(timed(f"bladesmith {args.level} (padded)", padded, images, None))
        relate(found)
        rows += found
        reports[str(batch)] = report.to_dict()
        del optimized
    print_table(rows, device, args)
    if args.json:
        write_json(args.json, rows, reports, device, args)


def without_tf32(fn):
    def call(*args):
        previous = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        try:
            return fn(*args)
        finally:
            torch.backends.cudnn.allow_tf32 = previous

    return call


class Timer:
    """Times one callable on the images and scores its detections against eager fp32's."""

    def __init__(self, warmup: int, iters: int, device, batch: int, model):
        self.warmup, self.iters, self.device, self.batch = warmup, iters, device, batch
        self.model = model  # eager float32, whose detections are the reference
        self.noisy = None  # its detections under rounding noise, made when first needed
        self.floor = None  # the lowest F1 of those against the model (see noise_floor)

    def __call__(self, name, fn, images, reference, build=False) -> dict:
        started = time.perf_counter()
        with torch.no_grad():
            outputs = fn(images)  # the first call builds what is lazy (compilation)
        first_call_s = time.perf_counter() - started
        with torch.no_grad():
            timing = measure(
                fn,
                (images,),
                warmup=self.warmup,
                iters=self.iters,
                device=self.device,
                batch_size=self.batch,
            )
        row = {"name": name, "batch": self.batch, "timing": timing.to_dict()}
        if build:
            row["build_s"] = first_call_s
        if reference is not None:
            comparison = compare_detections(reference, outputs)
            if not comparison.passed:  # as optimize's gate: rounding flips excused too
                if self.noisy is None:
                    runs = reference_under_noise(self.model, [(images,)])
                    self.noisy = [run[0] for run in runs]
                    self.floor = noise_floor(reference, self.noisy)
                comparison = compare_detections(reference, outputs, noisy=self.noisy)
                row["noise_floor_f1"] = self.floor
            row["f1"] = comparison.f1
            row["strict_f1"] = comparison.strict_f1
            row["max_score_deviation"] = comparison.max_score_deviation
            row["accuracy"] = comparison.summary()
        print(f"{name}, batch {self.batch}: {timing.p50_ms:.3f} ms (p50)", flush=True)
        return row


def noise_floor(reference, noisy) -> float:
    """The lowest F1 of the model's own detections under rounding noise (``noisy``, each
    with the others' flips excused) against its detections: where a chaotic model (a
    random-weight R-CNN) puts optimize's gate, which judges a pass at that floor when
    the runs differ in several detections (``engine.reference.Reference.noise_floor``)."""
    return min(
        compare_detections(reference, run, noisy=noisy[:i] + noisy[i + 1 :]).f1
        for i, run in enumerate(noisy)
    )


def relate(rows: list[dict]) -> None:
    """Speedups against eager and against torch.compile, at the same batch size."""
    by_name = {row["name"]: row["timing"]["mean_ms"] for row in rows}
    for row in rows:
        mean = row["timing"]["mean_ms"]
        row["vs_eager"] = by_name["eager fp32"] / mean
        if "torch.compile" in by_name:
            row["vs_compile"] = by_name["torch.compile"] / mean


def print_table(rows, device, args) -> None:
    from rich.console import Console
    from rich.table import Table

    height, width = args.input_size
    table = Table(
        title=f"RetinaNet R50-FPN, 3x{height}x{width}, realistic load, on {device_name(device)}",
        title_justify="left",
    )
    for column in ("Variant", "Batch", "Mean ms", "p50 ms", "p99 ms", "Images/s"):
        table.add_column(column, justify="left" if column == "Variant" else "right")
    for column in ("vs eager", "vs compile", "F1", "strict F1", "Build s"):
        table.add_column(column, justify="right")
    for row in rows:
        timing = row["timing"]
        table.add_row(
            row["name"],
            str(row["batch"]),
            f"{timing['mean_ms']:.3f}",
            f"{timing['p50_ms']:.3f}",
            f"{timing['p99_ms']:.3f}",
            f"{timing['throughput']:.0f}",
            f"{row['vs_eager']:.2f}x",
            f"{row['vs_compile']:.2f}x" if "vs_compile" in row else "-",
            f"{row['f1']:.4f}" if "f1" in row else "-",
            f"{row['strict_f1']:.4f}" if "strict_f1" in row else "-",
            f"{row['build_s']:.1f}" if "build_s" in row else "-",
        )
    console = Console(width=140)
    console.print(table)
    for row in rows:
        if "passes" in row:
            console.print(f"{row['name']}, batch {row['batch']}: kept {', '.join(row['passes'])}")


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def write_json(path, rows, reports, device, args) -> None:
    from bladesmith.report import software_context

    data = {
        "device": device_name(device),
        "input_size": list(args.input_size),
        "level": args.level,
        "software": software_context(),
        "rows": rows,
        "reports": reports,
    }
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    from bladesmith.cli.args import input_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--level", default="o1", choices=("o0", "o1", "o2"))
    parser.add_argument("--input-size", type=input_size, default=(480, 640), metavar="HxW")
    parser.add_argument(
        "--batches",
        type=lambda text: [int(b) for b in text.split(",")],
        default=None,
        help="comma-separated batch sizes (default: 1,32 on a GPU, 1 on a CPU)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="batch 1 (default 20; CPU 2)")
    parser.add_argument("--iters", type=int, default=None, help="batch 1 (default 100; CPU 10)")
    parser.add_argument("--warmup-large", type=int, default=5, help="larger batches")
    parser.add_argument("--iters-large", type=int, default=30, help="larger batches")
    parser.add_argument("--threads", type=int, help="torch CPU threads (the CPU target: 2)")
    parser.add_argument("--compile-cpu", action="store_true", help="also torch.compile on a CPU")
    parser.add_argument("--weights", help="local state dict for the model (default: random)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    args = parser.parse_args()
    on_gpu = bladesmith.devices.resolve_device(args.device).type == "cuda"
    if args.batches is None:
        args.batches = [1, 32] if on_gpu else [1]
    if args.warmup is None:
        args.warmup = 20 if on_gpu else 2
    if args.iters is None:
        args.iters = 100 if on_gpu else 10
    return args


if __name__ == "__main__":
    main()
