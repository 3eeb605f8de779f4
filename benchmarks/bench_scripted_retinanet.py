"""PAI-Blade's tutorial, on bladesmith: a scripted RetinaNet that calls its own decode/NMS
operators, optimized as a user's TorchScript model, side by side with the model as given.

    python benchmarks/bench_scripted_retinanet.py --device cpu --threads 2 --input-size 320x416
    python benchmarks/bench_scripted_retinanet.py --device cuda --batches 1 32

The user model is bladesmith's RetinaNet pipeline (torchvision R50-FPN, random weights
calibrated to a trained model's post-processing load) traced to TorchScript, where
post-processing is one call of ``torch.ops.bladesmith.retinanet_postprocess``, saved to
a ``.pt`` file and loaded back: what ``bladesmith.optimize`` gets is a TorchScript
module it did not build (no built-in adapter applies). Rows: the TorchScript model as
given, ``bladesmith.optimize`` of it, and its ``.pt`` artifact loaded again. Detections
are compared with the model's own (F1 over same-class matches at IoU >= 0.9, strict:
every unmatched detection counts). ``--json`` writes the rows and the report.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import bladesmith
from bladesmith.bench import measure
from bladesmith.families.retinanet import RetinaNetPipeline
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet
from bladesmith.runtimes.torchscript import quiet_torchscript
from bladesmith.verify import compare_detections


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = bladesmith.devices.resolve_device(args.device)
    bladesmith.ops.load_library()
    rows, reports = [], {}
    with tempfile.TemporaryDirectory(prefix="bladesmith-scripted-") as directory:
        model_file = Path(directory) / "retinanet.pt"
        source = script_retinanet(args.input_size, model_file, device)
        with quiet_torchscript():
            scripted = torch.jit.load(str(model_file), map_location=device).eval()
        for batch in args.batches:
            images = sample_images(batch, args.input_size, device=device)
            with torch.no_grad():
                reference = as_lists(scripted(images))
            timed = Timer(args.warmup, args.iters, device, batch, reference)
            found = [timed("TorchScript as given", scripted, images)]
            if device.type == "cuda" or args.compile_cpu:
                compiled = torch.compile(source, dynamic=False)
                found.append(timed("torch.compile of its source", compiled, images))
            started = time.perf_counter()
            optimized, spec, report = bladesmith.optimize(
                scripted,
                level=args.level,
                device=device,
                test_data=[(images,)],
                config=bladesmith.Config(warmup=args.warmup, iters=args.iters, progress=True),
            )
            found.append(timed(f"bladesmith {args.level}", optimized, images))
            found[-1].update(build_s=time.perf_counter() - started, passes=list(spec.passes))
            saved = bladesmith.save(optimized, Path(directory) / f"optimized-{batch}.pt")
            found.append(timed("its .pt, loaded again", bladesmith.load(saved), images))
            p50 = {row["name"]: row["timing"]["p50_ms"] for row in found}
            for row in found:
                row["speedup"] = p50["TorchScript as given"] / row["timing"]["p50_ms"]
                if "torch.compile of its source" in p50:
                    row["vs_compile"] = p50["torch.compile of its source"] / row["timing"]["p50_ms"]
            rows += found
            reports[str(batch)] = report.to_dict()
            print(report.diagnosis["message"], flush=True)
    print_table(rows, device, args)
    if args.json:
        payload = {"device": str(device), "args": vars(args), "rows": rows, "reports": reports}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def script_retinanet(image_size: tuple[int, int], path: Path, device: torch.device):
    """The user's model file: the fixed-shape pipeline traced to TorchScript on the
    device it will run on, as a user deploying it would (a trace records the device of
    every tensor it creates). Returns the pipeline it was traced from, the module
    ``torch.compile`` can take (it cannot read TorchScript)."""
    pipeline = RetinaNetPipeline(build_retinanet(image_size), image_size).to(device).eval()
    images = sample_images(1, image_size, device=device)
    with quiet_torchscript(), torch.no_grad():
        traced = torch.jit.trace(pipeline, (images,), check_trace=False)
        torch.jit.save(traced, str(path))
    return pipeline


def as_lists(outputs) -> list[dict]:
    """Padded (boxes, scores, labels, num_detections) -> torchvision's list of dicts."""
    boxes, scores, labels, counts = outputs
    return [
        {"boxes": boxes[i, :n], "scores": scores[i, :n], "labels": labels[i, :n]}
        for i, n in enumerate(counts.tolist())
    ]


class Timer:
    def __init__(self, warmup, iters, device, batch, reference):
        self.batch, self.reference = batch, reference
        self.options = dict(warmup=warmup, iters=iters, device=device, batch_size=batch)

    def __call__(self, name, fn, images) -> dict:
        with torch.no_grad():
            outputs = as_lists(fn(images))
            timing = measure(fn, (images,), **self.options)
        comparison = compare_detections(self.reference, outputs)
        print(f"{name}, batch {self.batch}: {timing.p50_ms:.1f} ms (p50)", flush=True)
        return {
            "name": name,
            "batch": self.batch,
            "timing": timing.to_dict(),
            "strict_f1": comparison.strict_f1,
            "accuracy": comparison.summary(),
        }


def print_table(rows: list[dict], device, args) -> None:
    print(
        f"\nScripted RetinaNet R50-FPN with its own post-processing operator, "
        f"{args.input_size[0]}x{args.input_size[1]}, {device}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"{'row':<28} {'batch':>5} {'p50 ms':>9} {'mean ms':>9} {'vs given':>9} "
        f"{'vs compile':>10} {'F1':>6}"
    )
    for row in rows:
        timing = row["timing"]
        versus = f"{row['vs_compile']:.2f}x" if "vs_compile" in row else "-"
        print(
            f"{row['name']:<28} {row['batch']:>5} {timing['p50_ms']:>9.2f} "
            f"{timing['mean_ms']:>9.2f} {row['speedup']:>8.2f}x {versus:>10} "
            f"{row['strict_f1']:>6.3f}"
        )
    for row in rows:
        if "passes" in row:
            print(f"batch {row['batch']}: kept {', '.join(row['passes']) or 'nothing'}")


def parse_args() -> argparse.Namespace:
    from bladesmith.cli.args import input_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", default="o1", choices=("o0", "o1", "o2"))
    parser.add_argument("--input-size", type=input_size, default=(480, 640), metavar="HxW")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--compile-cpu", action="store_true", help="time torch.compile on CPU")
    parser.add_argument("--json", metavar="PATH")
    return parser.parse_args()


if __name__ == "__main__":
    main()
