"""bladesmith's saved artifact against OpenVINO used by hand, on the CPU, in one process.

Each model is optimized (level o1, on the CPU), saved in the format its report measured,
and loaded back; OpenVINO by hand is what a user would write: ``ov.convert_model(model,
example_input=...)`` and ``compile_model(..., "CPU", {"PERFORMANCE_HINT": "LATENCY"})``,
nothing else tuned. The model as given, the loaded artifact and OpenVINO then run in
``--rounds`` interleaved rounds of ``--iters`` calls each; the table gives each one's
median latency over all its calls and its speedup over the model as given (the median
of the rounds' ratios, with their lowest and highest). Where OpenVINO cannot convert the
model as given (RetinaNet), the line says why, and bladesmith's artifact is timed
against the one ``optimize`` saves with the OpenVINO passes excluded instead; each
detector artifact's outputs are compared with the model's by the detection rule
(``verify.compare_detections``). Each model's lines end with the load average before
and after it (the machine may be shared).

    python3 benchmarks/openvino_vs_bladesmith.py [--models resnet50,mobilenet_v3_large,
        convnext_tiny,resnet50@32,retinanet] [--rounds 10] [--iters 5] [--search-iters N]
        [--level o1] [--exclude PASS,...]

``--level o2`` adds the quantizing passes (and Inductor, whose CPU build takes minutes:
``--exclude inductor`` leaves it out); the RetinaNet line without OpenVINO stays at o1,
today's result.

Torchvision models with random weights (``weights=None``) at 224x224, batch 1, or the
batch after ``@`` (a throughput row: images per second too); RetinaNet is the demo's
(``models.catalog.build_retinanet``) at 320x416 on a photograph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import bladesmith

SEED = 0
TORCHVISION = ("resnet50", "mobilenet_v3_large", "convnext_tiny")
MODELS = (*TORCHVISION, "resnet50@32", "retinanet")
WITHOUT_OPENVINO = ("openvino", "openvino_f32", "openvino_int8", "openvino_int8_mixed")


def build(name: str):
    """(model, args) of a model by name (``name@batch`` for another batch than 1),
    weights from ``SEED``."""
    import torchvision

    from bladesmith.images import sample_images
    from bladesmith.models.catalog import build_retinanet

    torch.manual_seed(SEED)
    if name == "retinanet":
        size = (320, 416)
        return build_retinanet(size), (list(sample_images(1, size)),)
    name, _, batch = name.partition("@")
    if name in TORCHVISION and (not batch or batch.isdigit() and int(batch) > 0):
        model = getattr(torchvision.models, name)(weights=None).eval()
        return model, (torch.rand(int(batch or 1), 3, 224, 224),)
    raise SystemExit(f"--models: unknown model {name!r} ({', '.join(MODELS)}, or name@batch)")


def openvino_by_hand(model, args):
    """OpenVINO as its documentation shows it, or the first line of why it failed."""
    import openvino as ov

    try:
        example = args[0] if len(args) == 1 else args
        converted = ov.convert_model(model, example_input=example)
        compiled = ov.Core().compile_model(converted, "CPU", {"PERFORMANCE_HINT": "LATENCY"})
    except Exception as error:  # the converter raises its own kinds
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    inputs = [x.numpy() for x in args if isinstance(x, torch.Tensor)]
    return (lambda: compiled(inputs)), None


def timed(run, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def interleaved(runs: dict, rounds: int, iters: int) -> dict:
    """Each run's calls in turn, round after round: {name: (all times, per-round medians)}."""
    for run in runs.values():  # warm-up
        timed(run, 2)
    times = {name: [] for name in runs}
    medians = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            each = timed(run, iters)
            times[name] += each
            medians[name].append(statistics.median(each))
    return {name: (times[name], medians[name]) for name in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--search-iters", type=int, help="Config.iters of optimize's search (its default: 10)"
    )
    parser.add_argument("--level", default="o1", choices=("o0", "o1", "o2"))
    parser.add_argument("--exclude", default="", help="passes optimize leaves out, by name")
    options = parser.parse_args()
    if options.rounds < 1 or options.iters < 1:
        parser.error("--rounds and --iters must be at least 1")
    print(
        f"torch threads {torch.get_num_threads()}; {options.rounds} rounds x {options.iters}; "
        f"level {options.level}" + (f", without {options.exclude}" if options.exclude else "")
    )
    search = {"iters": options.search_iters, "warmup": 1} if options.search_iters else {}
    excluded = tuple(filter(None, options.exclude.split(",")))
    for name in options.models.split(","):
        lines = compared(name, options.rounds, options.iters, search, options.level, excluded)
        print(lines, flush=True)


def saved_and_loaded(model, args, config: bladesmith.Config, level: str = "o1"):
    """What ``optimize`` at ``level`` saves for ``model``, loaded back: (loaded, spec,
    report, seconds the optimization took)."""
    started = time.perf_counter()
    optimized, spec, report = bladesmith.optimize(
        model, level, device="cpu", test_data=[args], config=config
    )
    took = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = bladesmith.save(optimized, Path(folder) / f"m{spec.save_formats[0]}")
        return bladesmith.load(path, trust=True), spec, report, took  # saved just now


def compared(name: str, rounds: int, iters: int, search: dict, level: str, excluded: tuple) -> str:
    """The lines of one model: what optimize kept, then each run's latency and speedup."""
    from bladesmith.verify import compare_detections

    load_before = os.getloadavg()[0]
    model, args = build(name)
    config = bladesmith.Config(progress=False, exclude=excluded, **search)
    loaded, spec, report, took = saved_and_loaded(model, args, config, level)
    lines = [
        f"{name}: kept {','.join(spec.passes) or 'nothing'} ({took:.0f} s), saved "
        f"{spec.save_formats[0]}"
    ]
    by_hand, why = openvino_by_hand(model, args)
    runs = {"eager": lambda: model(*args), "bladesmith": lambda: loaded(*args)}
    if by_hand is not None:
        runs["openvino"] = by_hand
    else:  # today's result: the same search without the OpenVINO passes
        config = bladesmith.Config(progress=False, exclude=WITHOUT_OPENVINO + excluded, **search)
        without, other, _, took = saved_and_loaded(model, args, config)
        lines.append(
            f"  without openvino: kept {','.join(other.passes) or 'nothing'} ({took:.0f} s), "
            f"saved {other.save_formats[0]}"
        )
        runs["no-openvino"] = lambda: without(*args)
    with torch.no_grad():
        if isinstance(args[0], list):  # a detector: its artifacts' outputs by the rule
            expected = model(*args)
            for who in ("bladesmith", "no-openvino"):
                check = compare_detections(expected, runs[who]())
                lines.append(
                    f"  {who} against the model as given: "
                    f"{'passed' if check.passed else 'FAILED'}, F1 {check.f1:.3f}, "
                    f"{check.matched}/{check.reference_count} matched"
                )
        result = interleaved(runs, rounds, iters)
    eager = result["eager"][1]
    images = next(x for x in args if isinstance(x, (torch.Tensor, list)))
    batch = len(images)
    for who, (times, medians) in result.items():
        ratios = [e / m for e, m in zip(eager, medians)]
        p50 = statistics.median(times)
        lines.append(
            f"  {who:<11} p50 {p50 * 1e3:8.2f} ms  "
            f"{statistics.median(ratios):5.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
            + (f"  {batch / p50:.1f} images/s" if batch > 1 else "")
        )
    if why is not None:
        lines.append(f"  openvino    not converted as given: {why}")
    for record in report.optimizations:  # what bladesmith's own OpenVINO passes did
        if record.name.startswith("openvino"):
            lines.append(f"  pass {record.name}: {record.status}: {record.reason}")
    lines.append(f"  load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
