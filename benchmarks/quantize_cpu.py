"""bladesmith's INT8 result against its best float result and NNCF used by hand, on the
CPU, in one process.

For each model (torchvision, 224x224, batch ``--batch``): with ``--task regions`` (the
default) its backbone random and its head trained on which region of which photograph
a view shows (``region_task.py``: weights cannot be downloaded, and a random classifier
answers noise), test data one batch of views, and 32 other views given as
``Config(calibration_data=...)`` and 100 others as ``Config(held_out_data=...)``, as
the task's user would give them; with ``--task random`` the random weights as they are
and the inputs derived from views of the photographs. Timed: the model as given;
bladesmith's best float result (level o1), saved in the format its report measured and
loaded back; bladesmith's INT8 result (level o2 without Inductor, whose CPU compile takes
minutes here: the openvino_int8 passes), saved and loaded back; and NNCF by hand, as its
documentation shows it: ``ov.convert_model``, ``nncf.quantize`` on the same calibration
inputs, ``compile_model(..., "CPU", {"PERFORMANCE_HINT": "LATENCY"})``. They run in
``--rounds`` interleaved rounds of ``--iters`` calls each; each line gives the median
latency over all its calls and its speedup over bladesmith's float result (the median of
the rounds' ratios, with their lowest and highest). Top-1 agreement with the model as
given is counted on ``--held-out`` other views that neither calibration nor optimize saw.

    python3 benchmarks/quantize_cpu.py [--models resnet50,mobilenet_v3_large]
        [--rounds 10] [--iters 5] [--held-out 200] [--batch 2] [--task regions|random]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import bladesmith
import region_task
from bladesmith.images import varied_photos
from bladesmith.verify.heldout import calibration_inputs
from openvino_vs_bladesmith import interleaved

SEED = 0
MODELS = ("resnet50", "mobilenet_v3_large")


def nncf_by_hand(model, example: torch.Tensor, calibration: list[torch.Tensor]):
    """NNCF's post-training INT8 as its documentation shows it: (compiled model, seconds)."""
    import nncf
    import openvino as ov

    started = time.perf_counter()
    converted = ov.convert_model(model, example_input=example)
    quantized = nncf.quantize(
        converted, nncf.Dataset(calibration, lambda x: x.numpy()), subset_size=len(calibration)
    )
    compiled = ov.Core().compile_model(quantized, "CPU", {"PERFORMANCE_HINT": "LATENCY"})
    return compiled, time.perf_counter() - started


def top1(run, views: torch.Tensor, batch: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [
                torch.as_tensor(run(views[i : i + batch])).argmax(-1)
                for i in range(0, len(views), batch)
            ]
        )


def compared(name: str, options) -> str:
    import torchvision

    torch.manual_seed(SEED)
    model = getattr(torchvision.models, name)(weights=None).eval()
    data = {}  # the user's calibration and held-out inputs, where the task has them
    if options.task == "regions":
        accuracy = region_task.trained(model)
        x = region_task.views(options.batch, (224, 224), seed=7)[0]
        views, labels = region_task.views(options.held_out, (224, 224), seed=123)
        weights = f"random backbone, head trained on regions (train accuracy {accuracy:.3f})"
        # Views of the task, as its user would give them: the derived ones are whole
        # photographs, which this model was never meant to answer.
        for setting, count, seed in (("calibration_data", 32, 11), ("held_out_data", 100, 99)):
            batches = region_task.views(count, (224, 224), seed=seed)[0].split(options.batch)
            data[setting] = [(each,) for each in batches]
    else:
        x = varied_photos(options.batch, (224, 224))
        views, labels = varied_photos(options.held_out + 1, (224, 224), seed=123)[1:], None
        views[::2] = views[::2].flip(-1)
        weights = "random weights"
    lines = [f"{name} (batch {options.batch}, 224x224, {weights})"]
    loaded, built = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for label, level, config in (
            ("float", "o1", bladesmith.Config(progress=False, **data)),
            ("int8", "o2", bladesmith.Config(progress=False, exclude=["inductor"], **data)),
        ):
            started = time.perf_counter()
            optimized, spec, report = bladesmith.optimize(
                model, level, device="cpu", test_data=[x], config=config
            )
            built[label] = time.perf_counter() - started
            suffix = spec.save_formats[0]
            loaded[label] = bladesmith.load(
                bladesmith.save(optimized, Path(folder) / f"{label}{suffix}")
            )
            lines.append(
                f"  bladesmith {label}: {level}, kept {','.join(spec.passes) or 'nothing'} in "
                f"{spec.dtype} ({built[label]:.0f} s), saved {suffix}"
            )
            for record in report.optimizations:
                if record.name.startswith("openvino_int8"):
                    lines.append(f"    {record.name}: {record.status}: {record.reason}")
    calibration = [
        args[0] for args in data.get("calibration_data") or calibration_inputs([(x,)]).args
    ]
    compiled, took = nncf_by_hand(model, x, calibration)
    lines.append(
        f"  NNCF by hand: {sum(len(c) for c in calibration)} calibration images ({took:.0f} s)"
    )
    runs = {
        "model as given": lambda: model(x),
        "bladesmith float": lambda: loaded["float"](x),
        "bladesmith int8": lambda: loaded["int8"](x),
        "NNCF int8 by hand": lambda: compiled([x.numpy()]),
    }
    with torch.no_grad():
        result = interleaved(runs, options.rounds, options.iters)
    reference = top1(model, views, options.batch)
    agreement = {
        "bladesmith float": top1(loaded["float"], views, options.batch),
        "bladesmith int8": top1(loaded["int8"], views, options.batch),
        "NNCF int8 by hand": top1(lambda v: compiled([v.numpy()])[0], views, options.batch),
    }
    base = result["bladesmith float"][1]
    for who, (times, medians) in result.items():
        ratios = [b / m for b, m in zip(base, medians, strict=True)]
        agree = agreement.get(who)
        shown = (
            f"top-1 agreement {float((agree == reference).float().mean()):.3f}"
            if agree is not None
            else ""
        )
        lines.append(
            f"  {who:<18} p50 {statistics.median(times) * 1e3:8.2f} ms  "
            f"{statistics.median(ratios):5.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] "
            f"of float  {shown}"
        )
    right = (
        ""
        if labels is None
        else f", its accuracy {float((reference == labels).float().mean()):.3f}"
    )
    lines.append(
        f"  held-out views: {len(views)}, classes the model gives them: "
        f"{reference.unique().numel()}{right}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--task",
        choices=("regions", "random"),
        default="regions",
        help="regions: a head trained on which region of which photograph a view shows "
        "(region_task.py); random: the random weights as they are (answers noise)",
    )
    options = parser.parse_args()
    if min(options.rounds, options.iters, options.held_out, options.batch) < 1:
        parser.error("--rounds, --iters, --held-out and --batch must be at least 1")
    flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0].split()
    isa = [f for f in flags if "vnni" in f or f in ("avx2", "avx512f", "avx512_bf16", "amx_int8")]
    model_name = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in model_name.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    print(
        f"{cpu}; {', '.join(isa) or 'no AVX2'}; torch threads {torch.get_num_threads()}; "
        f"{options.rounds} rounds x {options.iters}"
    )
    for name in options.models.split(","):
        print(compared(name, options), flush=True)


if __name__ == "__main__":
    main()
