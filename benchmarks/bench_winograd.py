"""The winograd pass on a CPU: per-convolution timings, and optimize with and without it.

    python benchmarks/bench_winograd.py                 # RetinaNet R50-FPN, 3x480x640
    python benchmarks/bench_winograd.py --skip-shapes

First table: each 3x3 stride-1 convolution shape of the model, ms per call (median of
interleaved rounds) with oneDNN (``F.conv2d``, channels_last), PyTorch's NNPACK entry
point (``torch._nnpack_spatial_convolution``, Winograd F(6x6, 3x3), its kernel
transformed on every call) and the pass's operator (F(4x4, 3x3)), with each one's error
against float64. Second: torchvision eager against
``bladesmith.optimize(device="cpu")`` without and with the winograd pass, timed in
interleaved rounds (the order reversed every other round) so that load from elsewhere
hits every row alike, with the F1 of their detections against eager's (near ties
excused, and strict). The machine's CPU use by others and steal time during the timing
are printed: figures taken while others used the cores are not comparable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import bladesmith
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet
from bladesmith.passes import winograd
from bladesmith.verify import compare_detections

# (in channels, height, width, out channels): RetinaNet R50-FPN's 3x3 stride-1 shapes
# at 480x640 (head and FPN at P3-P7, ResNet stages 1-4).
SHAPES = [
    (256, 60, 80, 256), (256, 60, 80, 819), (256, 30, 40, 256), (256, 30, 40, 819),
    (256, 15, 20, 256), (256, 8, 10, 256), (256, 4, 5, 256), (64, 120, 160, 64),
    (128, 60, 80, 128), (512, 15, 20, 512), (256, 60, 80, 36),
]  # fmt: skip


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load {loadavg()}")
    if winograd.unavailable():
        raise SystemExit(winograd.unavailable())
    if not args.skip_shapes:
        shapes_table(args.rounds)
    models_table(args.rounds)


def shapes_table(rounds: int) -> None:
    nnpack = torch.backends.nnpack.is_available()
    print("\nms per call, median   oneDNN  torch NNPACK  winograd op  (op vs oneDNN)", end="")
    print("  error: NNPACK, op")
    with torch.no_grad():
        for channels, height, width, out in SHAPES:
            x = torch.randn(1, channels, height, width).to(memory_format=torch.channels_last)
            weight = torch.randn(out, channels, 3, 3) * (channels * 9) ** -0.5
            runs = conv_runs(x, weight, torch.zeros(out), nnpack)
            expected = F.conv2d(x.double(), weight.double(), padding=1)
            error = {
                n: ((run().double() - expected).abs().max() / expected.abs().max()).item()
                for n, run in runs.items()
            }
            times = interleaved(runs, rounds, calls=3)
            ms = {name: statistics.median(values) for name, values in times.items()}
            shape = f"{channels}->{out} at {height}x{width}"
            nan = float("nan")
            print(
                f"{shape:20s} {ms['onednn']:8.2f} {ms.get('torch', nan):13.2f} {ms['op']:12.2f}"
                f"  ({ms['onednn'] / ms['op']:.2f}x)"
                f"  {error.get('torch', nan):.1e}, {error['op']:.1e}"
            )


def conv_runs(x, weight, bias, nnpack: bool) -> dict:
    runs = {
        "onednn": lambda: F.conv2d(x, weight, bias, 1, 1),
        "op": lambda: torch.ops.bladesmith.winograd_conv3x3(x, weight, bias, False),
    }
    if nnpack:
        runs["torch"] = lambda: torch._nnpack_spatial_convolution(x, weight, bias, [1, 1])
    return runs


def models_table(rounds: int) -> None:
    model = build_retinanet((480, 640))
    images = list(sample_images(1, (480, 640)))
    with torch.no_grad():
        reference = model(images)
    rows = {"torchvision eager": model}
    for label, exclude in (("optimize, no winograd", ("winograd",)), ("optimize", ())):
        config = bladesmith.Config(exclude=exclude, progress=False)
        optimized, spec, report = bladesmith.optimize(
            model, device="cpu", test_data=[(images,)], config=config
        )
        print(f"\n{label}: kept {', '.join(spec.passes)}")
        print("\n".join(n for n in report.diagnosis["notes"] if n.startswith("winograd")))
        rows[label] = optimized
    with torch.no_grad():
        accuracy = {name: compare_detections(reference, run(images)) for name, run in rows.items()}
        before = cpu_counters()
        calls = {name: lambda run=run: run(images) for name, run in rows.items()}
        times = interleaved(calls, rounds)
        others, steal = cpu_counters(before)
    eager = statistics.median(times["torchvision eager"])
    print(f"\n{'':24s} median ms    min  vs eager    F1  strict F1")
    for name, values in times.items():
        median, comparison = statistics.median(values), accuracy[name]
        print(
            f"{name:24s} {median:9.1f} {min(values):6.0f} {eager / median:8.2f}x"
            f" {comparison.f1:6.3f} {comparison.strict_f1:9.3f}"
        )
    print(f"while timing: others used {others:.2f} cores, steal {steal:.2f}; load {loadavg()}")


def interleaved(runs: dict, rounds: int, calls: int = 1) -> dict[str, list[float]]:
    """ms of each run's last call of ``calls`` in a row, over ``rounds`` rounds, the order
    reversed every other round."""
    times = {name: [] for name in runs}
    for run in runs.values():
        run()
    for index in range(rounds):
        order = list(runs.items())
        for name, run in order if index % 2 == 0 else order[::-1]:
            for _ in range(calls - 1):
                run()
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def cpu_counters(before=None):
    """(busy, steal, our CPU seconds) now, or since ``before`` as (cores used by other
    processes, cores stolen by the hypervisor)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    ticks = os.sysconf("SC_CLK_TCK")
    busy = (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / ticks
    usage = os.times()
    now = (busy, fields[7] / ticks, usage.user + usage.system, time.perf_counter())
    if before is None:
        return now
    wall = now[3] - before[3]
    others = max(0.0, (now[0] - before[0]) - (now[2] - before[2]))
    return others / wall, (now[1] - before[1]) / wall


def loadavg() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--skip-shapes", action="store_true", help="only the whole model")
    return parser.parse_args()


if __name__ == "__main__":
    main()
