"""The compiled artifact (``.ptc``) against the result it was saved from: each model
optimized (o1 on a GPU, where Inductor and the CUDA graph are tried; on a CPU only the
inductor pass, at o2, where it runs), saved as ``.ptc`` with each Inductor setting asked
for (or as an AOTInductor ``.pt2``: ``--settings pt2``), and reloaded in a new process
that times it in rounds taking turns with the optimized module timed here
(``bench.from_rounds``: the same statistic as the report).
A ratio is in-process latency over the reloaded file's: 1.00x keeps the speed, the
issue's bar is 0.90x. Also printed: the build (optimize, the save's compile, from the
cache on a second save) and the new process's load and first call.

    python3 benchmarks/compiled_artifact.py --device cuda [--models resnet50_b1,...]
        [--settings default,max_autotune,freezing] [--json out.json]

Models: ResNet-50 at 224x224, batch 1 and 32; RetinaNet R50-FPN 480x640 (bladesmith's,
realistic load), FCOS, SSDlite 320 and Faster R-CNN at batch 1, random weights,
photographs from skimage; BERT-base at batch 8 x 128 tokens where transformers is
installed (said so where not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import bladesmith
from bladesmith import bench
from bladesmith.fresh_load import conversation

# The new process: load (timed), first call (timed), then a round per request.
_CHILD = """
import sys, time, torch, bladesmith
from bladesmith import bench
start = time.perf_counter()
module = bladesmith.load(sys.argv[1], trust=True)  # written by this script
loaded = time.perf_counter() - start
args = torch.load(sys.argv[2], weights_only=False)
with torch.no_grad():
    start = time.perf_counter()
    module(*args)
    bench.time_round(module, args, 1)  # synchronised
    first = time.perf_counter() - start
    for calls in requests():
        reply([loaded, first] if calls == "start" else bench.time_round(module, args, calls))
"""
# setting: (the format saved, Inductor's settings for a .ptc); "pt2" is the same result
# as an AOTInductor package, whose library is built at save and loaded without compiling.
SETTINGS = {
    "default": (".ptc", None),
    "max_autotune": (".ptc", {"max_autotune": True}),
    "freezing": (".ptc", {"freezing": True}),
    "pt2": (".pt2", None),
    "pt2_freezing": (".pt2", {"freezing": True}),
}


def build(name: str, device: torch.device):
    """(model, its test input as a call's arguments) by name; None when it cannot be
    built here (transformers missing)."""
    import torchvision

    from bladesmith.families.fcos import build_fcos
    from bladesmith.families.rcnn import build_rcnn
    from bladesmith.families.ssd import build_ssd
    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    torch.manual_seed(0)
    if name.startswith("resnet50_b"):
        batch = int(name.removeprefix("resnet50_b"))
        return torchvision.models.resnet50().eval(), (torch.rand(batch, 3, 224, 224),)
    if name == "bert_base_b8x128":
        try:
            import transformers
        except ImportError:
            return None
        config = transformers.BertConfig()
        model = transformers.BertModel(config).eval()
        return model, (torch.randint(0, config.vocab_size, (8, 128)),)
    size = {"ssdlite": (320, 320)}.get(name, (480, 640))
    builders = {
        "retinanet": lambda: build_retinanet(size),
        "fcos": lambda: build_fcos(size),
        "ssdlite": lambda: build_ssd("ssdlite320_mobilenet_v3_large"),
        "faster_rcnn": lambda: build_rcnn("fasterrcnn_resnet50_fpn", size),
    }
    return builders[name](), (list(sample_images(1, size)),)


def measure(name: str, device: torch.device, settings: list[str], args) -> list[dict]:
    built = build(name, device)
    if built is None:
        print(f"{name}: skipped (transformers is not installed)", flush=True)
        return [{"model": name, "skipped": "transformers is not installed"}]
    model, call = built
    batch = len(call[0]) if isinstance(call[0], list) else call[0].shape[0]
    passes = None
    level = "o1"
    if device.type == "cpu":  # Inductor runs on a CPU at o2; the other passes left out
        from bladesmith.passes.inductor import Inductor

        passes, level = [Inductor()], "o2"
    start = time.perf_counter()
    config = bladesmith.Config(save_as=".ptc", warmup=args.warmup, iters=args.iters)
    optimized, spec, report = bladesmith.optimize(
        model, device=device, level=level, test_data=[call], config=config, passes=passes
    )
    optimize_s = time.perf_counter() - start
    base = {
        "model": name,
        "device": str(device),
        "batch": batch,
        "passes": list(spec.passes),
        "save_formats": list(spec.save_formats),
        "optimize_s": round(optimize_s, 1),
        "report_in_process": "{:.2f}x [{:.2f}-{:.2f}]".format(
            report.diagnosis["speedup"], *report.diagnosis["interval"]
        ),
        "report_saved": report.diagnosis["saved"],
    }
    if ".ptc" not in spec.save_formats:
        print(f"{name}: no .ptc ({spec.refused_formats.get('.ptc')})", flush=True)
        return [{**base, "skipped": spec.refused_formats.get(".ptc", "not saved")}]
    call = tuple(
        [x.to(device) for x in each] if isinstance(each, list) else each.to(device) for each in call
    )
    rows = []
    for setting in settings:
        with tempfile.TemporaryDirectory(prefix="compiled-artifact-") as folder:
            suffix, configs = SETTINGS[setting]
            path = Path(folder) / f"{name}{suffix}"
            start = time.perf_counter()
            bladesmith.save(optimized, path, inductor_configs=configs)
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            bladesmith.save(optimized, Path(folder) / f"again{suffix}", inductor_configs=configs)
            again_s = time.perf_counter() - start
            row = {**base, "setting": setting, "save_s": round(save_s, 1)}
            row["second_save_s"] = round(again_s, 2)
            row["file_mb"] = round(path.stat().st_size / 2**20, 1)
            row.update(_in_turn(optimized, path, call, device, batch, args))
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _in_turn(optimized, path: Path, call: tuple, device, batch: int, args) -> dict:
    """The optimized module here and the file in a new process, timed in turn."""
    sizes = bench.round_sizes(args.iters, args.rounds)
    here, there = [], []
    with conversation(_CHILD, path, call) as ask, torch.no_grad():
        load_s, first_s = ask("start")
        ask(max(args.warmup, 1))
        bench.time_round(optimized, call, max(args.warmup, 1), device)
        for index, size in enumerate(sizes):
            for side in (0, 1) if index % 2 == 0 else (1, 0):
                if side == 0:
                    here.append(bench.time_round(optimized, call, size, device))
                else:
                    there.append(tuple(ask(size)))
    speedup = bench.from_rounds(here, there, warmup=0, batch_size=batch, device=device)
    return {
        "load_s": round(load_s, 2),
        "first_call_s": round(first_s, 2),
        "in_process_p50_ms": round(speedup.baseline.p50_ms, 3),
        "saved_p50_ms": round(speedup.candidate.p50_ms, 3),
        "saved_over_in_process": speedup.describe(),
        "ratio": speedup.ratio,
        "low": speedup.low,
        "high": speedup.high,
        "doubts": list(speedup.doubts),
    }


def _line(row: dict) -> str:
    return (
        f"{row['model']} ({row['setting']}, {row['device']}, b{row['batch']}): in process "
        f"{row['in_process_p50_ms']} ms, saved {row['saved_p50_ms']} ms -> "
        f"{row['saved_over_in_process']} of in-process; save {row['save_s']} s (again "
        f"{row['second_save_s']} s), load {row['load_s']} s + first call "
        f"{row['first_call_s']} s; report: in process {row['report_in_process']}, saved "
        f"{row['report_saved'].get('ratio', row['report_saved'].get('why'))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--models",
        default="resnet50_b1,resnet50_b32,retinanet,fcos,ssdlite,faster_rcnn,bert_base_b8x128",
    )
    parser.add_argument("--settings", default="default", help=", ".join(SETTINGS))
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    counts = bladesmith.Config().timing_counts(device.type)
    args.warmup = counts[0] if args.warmup is None else args.warmup
    args.iters = counts[1] if args.iters is None else args.iters
    settings = args.settings.split(",")
    unknown = [each for each in settings if each not in SETTINGS]
    if unknown:
        sys.exit(f"--settings: unknown {', '.join(unknown)}; expected {', '.join(SETTINGS)}")
    rows = []
    for name in args.models.split(","):
        try:
            rows += measure(name, device, settings, args)
        except Exception as error:  # one model's failure keeps the others' figures
            print(f"{name}: failed: {type(error).__name__}: {error}", flush=True)
            rows.append({"model": name, "failed": f"{type(error).__name__}: {error}"})
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
