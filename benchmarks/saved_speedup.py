"""The report's speedups against a reload's: each model optimized on the CPU, its report's
in-process and saved figures (with their intervals), then the artifact saved with
``bladesmith.save`` and reloaded ``--reloads`` times, each in a new process and timed
there alone, against the model as given timed alone here just before and just after;
the reloads' median ratio should lie inside the saved figure's interval. Each reload's
ratio is printed too: one phase against the next moves with the machine's load.

    python3 benchmarks/saved_speedup.py [--iters 20] [--reloads 3] [--models retinanet,...]

RetinaNet is the built-in one (ResNet-50 FPN, random weights, realistic load) on a small
image; ResNet-50 torchvision's at 224x224; the timm model timm's ResNet-18 when timm is
installed (said so when not).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import bladesmith
from bladesmith import bench
from bladesmith.fresh_load import in_new_process

_CHILD = """
import sys, torch, bladesmith
from bladesmith import bench
module = bladesmith.load(sys.argv[1])
job = torch.load(sys.argv[2], weights_only=False)
with torch.no_grad():
    timing = bench.measure(module, job["args"], warmup=job["warmup"], iters=job["iters"])
torch.save(timing.p50_ms, sys.argv[3])
"""


def models(names: list[str]):
    """(name, model, test input) of each model asked for that can be built here."""
    import torchvision

    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    for name in names:
        if name == "retinanet":
            size = (192, 256)
            yield name, build_retinanet(size), (list(sample_images(1, size)),)
        elif name == "resnet50":
            yield name, torchvision.models.resnet50().eval(), (torch.rand(1, 3, 224, 224),)
        elif name == "timm":
            try:
                import timm
            except ImportError:
                print("timm: not installed here (pip install timm); skipped")
                continue
            model = timm.create_model("resnet18", pretrained=False).eval()
            yield "timm resnet18", model, (torch.rand(1, 3, 224, 224),)


def reload_ratios(optimized, suffix: str, model, args: tuple, iters: int, reloads: int):
    """Per reload, the model as given's p50 here (the mean of one phase just before and
    one just after) over the saved file's p50 in a new process; and how."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        path = bladesmith.save(optimized, Path(folder) / f"model{suffix}")
        for _ in range(reloads):
            job = dict(args=args, warmup=5, iters=iters)
            with torch.no_grad():
                before = bench.measure(model, args, warmup=3, iters=iters).p50_ms
                saved, problem = in_new_process(_CHILD, path, job)
                after = bench.measure(model, args, warmup=1, iters=iters).p50_ms
            if problem:
                raise RuntimeError(problem)
            given = (before + after) / 2
            results.append((given / saved, f"{given:.1f} -> {saved:.1f} ms"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--models", default="retinanet,resnet50,timm")
    options = parser.parse_args()
    config = bladesmith.Config(warmup=3, iters=options.iters, progress=False)
    rows = []
    for name, model, args in models(options.models.split(",")):
        optimized, spec, report = bladesmith.optimize(
            model, "o1", device="cpu", test_data=[args], config=config
        )
        overall, saved = report.overall, report.saved
        if not saved.get("measured"):
            rows.append((name, spec.passes, overall, saved, None, saved.get("why")))
            continue
        reloads = reload_ratios(
            optimized, saved["format"], model, args, options.iters, options.reloads
        )
        ratio = statistics.median(each for each, _ in reloads)
        inside = sum(saved["low"] <= each <= saved["high"] for each, _ in reloads)
        how = f"{inside} of {len(reloads)} inside: " + "; ".join(
            f"{each:.2f}x ({text})" for each, text in reloads
        )
        rows.append((name, spec.passes, overall, saved, ratio, how))
    print(f"{'model':<14} {'kept':<40} {'in-process':<22} {'saved (report)':<26} reloads")
    for name, passes, overall, saved, ratio, how in rows:
        low, high = overall["interval"] or (1.0, 1.0)
        in_process = f"{overall['speedup']:.2f}x [{low:.2f}-{high:.2f}]"
        if ratio is None:
            print(f"{name:<14} {','.join(passes):<40} {in_process:<22} not measured: {how}")
            continue
        figure = f"{saved['format']} {saved['ratio']:.2f}x [{saved['low']:.2f}-{saved['high']:.2f}]"
        inside = "inside" if saved["low"] <= ratio <= saved["high"] else "OUTSIDE"
        print(
            f"{name:<14} {','.join(passes):<40} {in_process:<22} {figure:<26} "
            f"median {ratio:.2f}x, {inside} the saved interval: {how}"
        )


if __name__ == "__main__":
    main()
