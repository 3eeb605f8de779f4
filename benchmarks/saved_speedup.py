"""The report's speedups against a reload's: each model optimized on the CPU, its report's
in-process and saved figures (with their intervals), then the artifact saved with
``bladesmith.save`` and reloaded ``--reloads`` times, each in a new process that also
builds the model as given (the same seed, the same weights) and times the two there in
alternating rounds (``bench.compare``, none of optimize's code); the reloads' median
ratio should lie inside the saved figure's interval.

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
from bladesmith.fresh_load import in_new_process

_CHILD = f"""
import sys, torch, bladesmith
from bladesmith import bench
sys.path.insert(0, {str(Path(__file__).parent)!r})
from saved_speedup import build, fingerprint
loaded = bladesmith.load(sys.argv[1], trust=True)  # saved by this script
job = torch.load(sys.argv[2], weights_only=False)
_, model, _ = build(job["name"])
assert fingerprint(model) == job["fingerprint"], "the model as given was not rebuilt"
with torch.no_grad():
    speedup = bench.compare(model, loaded, job["args"], warmup=5, iters=job["iters"])
torch.save([speedup.ratio, speedup.low, speedup.high], sys.argv[3])
"""
SEED = 0


def build(name: str):
    """(label, model, test input) of a model by name, weights from ``SEED``; None when it
    cannot be built here."""
    import torchvision

    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    torch.manual_seed(SEED)
    if name == "retinanet":
        size = (192, 256)
        return name, build_retinanet(size), (list(sample_images(1, size)),)
    if name == "resnet50":
        return name, torchvision.models.resnet50().eval(), (torch.rand(1, 3, 224, 224),)
    if name == "timm":
        try:
            import timm
        except ImportError:
            print("timm: not installed here (pip install timm); skipped")
            return None
        model = timm.create_model("resnet18", pretrained=False).eval()
        return "timm resnet18", model, (torch.rand(1, 3, 224, 224),)
    raise SystemExit(f"--models: unknown model {name!r} (retinanet, resnet50, timm)")


def fingerprint(model) -> float:
    """A sum over the weights: the same in a process that rebuilt the same model."""
    return float(
        sum(p.double().sum() for p in model.state_dict().values() if p.is_floating_point())
    )


def reload_ratios(optimized, suffix: str, name: str, model, args: tuple, iters: int, reloads: int):
    """Per reload, in a new process: the model as given over the saved file, timed there
    in alternating rounds: (ratio, low, high)."""
    results = []
    job = dict(name=name, args=args, iters=iters, fingerprint=fingerprint(model))
    with tempfile.TemporaryDirectory() as folder:
        path = bladesmith.save(optimized, Path(folder) / f"model{suffix}")
        for _ in range(reloads):
            result, problem = in_new_process(_CHILD, path, job)
            if problem:
                raise RuntimeError(problem)
            results.append(tuple(result))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--models", default="retinanet,resnet50,timm")
    options = parser.parse_args()
    for flag in ("iters", "reloads"):
        if getattr(options, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    config = bladesmith.Config(warmup=3, iters=options.iters, progress=False)
    rows = []
    for key in options.models.split(","):
        built = build(key)
        if built is None:
            continue
        name, model, args = built
        optimized, spec, report = bladesmith.optimize(
            model, "o1", device="cpu", test_data=[args], config=config
        )
        overall, saved = report.overall, report.saved
        if not saved.get("measured"):
            rows.append((name, spec.passes, overall, saved, None, saved.get("why")))
            continue
        reloads = reload_ratios(
            optimized, saved["format"], key, model, args, options.iters, options.reloads
        )
        ratio = statistics.median(each for each, _, _ in reloads)
        inside = sum(saved["low"] <= each <= saved["high"] for each, _, _ in reloads)
        how = f"{inside} of {len(reloads)} inside: " + "; ".join(
            f"{each:.2f}x [{low:.2f}-{high:.2f}]" for each, low, high in reloads
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
