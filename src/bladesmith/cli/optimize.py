"""`bladesmith optimize`, `bladesmith bench` and `bladesmith demo`.

    bladesmith optimize torchvision:retinanet_resnet50_fpn --device cuda --out rn.pt2
    bladesmith optimize model.pt --input-size 224x224 --batch 8 --report report.json
    bladesmith bench rn.pt2 rn.pt
    bladesmith demo

Only argparse is imported here; torch and the engine are imported when a command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bladesmith.cli.args import (
    add_library_options,
    add_trust_option,
    batch_sizes,
    check_images_fit,
    input_size,
    output_file,
    pass_name,
    readable_file,
    save_file,
)
from bladesmith.cli.models import DEFAULT_MODEL, MODEL_HELP, image_flags_advice, model_or_file
from bladesmith.config import SETTINGS

DEFAULT_INPUT_SIZE = (480, 640)
# The save formats are runtimes.formats.FORMATS', which imports torch: --out is checked
# against them when given, and `bladesmith doctor` lists them.
SAVE_HELP = "its suffix picks the format (bladesmith doctor lists the formats)"
# A 2-core CPU takes seconds per call of the full detector: the demo times few runs there.
DEMO_CPU_TIMING = (1, 3)


def add_parser(subparsers) -> None:
    optimize = subparsers.add_parser(
        "optimize",
        help="optimize a model: baseline, passes, verified result, report",
        description=(
            "Optimize a built-in model (random weights unless --weights) or a "
            "TorchScript (.pt) / torch.export (.pt2) file on sample photographs, print the "
            "report, and optionally save the result (--out)."
        ),
    )
    optimize.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"{MODEL_HELP} (default: {DEFAULT_MODEL})",
    )
    optimize.add_argument(
        "--weights",
        type=readable_file,
        metavar="FILE",
        help="state dict for the built-in model (local file; a training checkpoint that "
        "holds one under 'model', 'state_dict', ... is unwrapped)",
    )
    _add_run_options(optimize)
    add_library_options(optimize)
    add_trust_option(optimize)
    optimize.add_argument(
        "--out",
        type=save_file,
        metavar="PATH",
        help=f"save the optimized model; {SAVE_HELP}; passes whose result cannot be saved "
        "in that format are skipped",
    )
    optimize.set_defaults(func=run_optimize)

    demo = subparsers.add_parser(
        "demo",
        help=f"optimize {DEFAULT_MODEL} on the best device here and print the report",
        description=(
            f"The main job in one command: {DEFAULT_MODEL} (random weights calibrated to "
            "a trained model's load) on a real photograph, optimized "
            "for the best device here. On a CPU, candidates are timed with 1 warm-up and 3 "
            "runs (--warmup/--iters for more)."
        ),
    )
    _add_run_options(demo)
    demo.add_argument(
        "--out",
        type=save_file,
        metavar="PATH",
        help=f"save the optimized model; {SAVE_HELP}",
    )
    demo.set_defaults(func=run_demo, model=DEFAULT_MODEL, weights=None)

    bench = subparsers.add_parser(
        "bench",
        help="time saved artifacts side by side",
        description=(
            "Load each artifact written by bladesmith (optimize --out), run it on "
            "photographs of the shape it was built for, and print one table: latency, "
            "throughput, speedup over the first, and agreement of outputs with the first's."
        ),
    )
    bench.add_argument(
        "artifacts",
        nargs="+",
        type=readable_file,
        metavar="ARTIFACT",
        help="files bladesmith.save wrote",
    )
    add_trust_option(bench)
    bench.add_argument("--warmup", type=SETTINGS["warmup"].parse, help=SETTINGS["warmup"].doc)
    bench.add_argument("--iters", type=SETTINGS["iters"].parse, help=SETTINGS["iters"].doc)
    bench.add_argument(
        "--json", type=output_file(), metavar="PATH", help="also write the table as JSON"
    )
    add_library_options(bench)
    bench.set_defaults(func=run_bench)


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="auto", help="auto, cuda, cuda:N, cpu, ... (default: auto)"
    )
    parser.add_argument(
        "--level",
        default="o1",
        choices=("o0", "o1", "o2"),
        help="o0: no precision change; o1: + fp16/bf16 if accurate; o2: + longer builds",
    )
    parser.add_argument(
        "--input-size",
        type=input_size,
        default=DEFAULT_INPUT_SIZE,
        metavar="HxW",
        help="image height x width (default: 480x640)",
    )
    parser.add_argument(
        "--batch",
        type=batch_sizes,
        default=(1,),
        metavar="N[,N...]",
        help="images per call (default 1); several sizes (1,8,32) give test data of each, "
        "the first timed: a .pt2 then holds a model for each, which serve uses as buckets",
    )
    parser.add_argument("--warmup", type=SETTINGS["warmup"].parse, help=SETTINGS["warmup"].doc)
    parser.add_argument("--iters", type=SETTINGS["iters"].parse, help=SETTINGS["iters"].doc)
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        type=pass_name,
        metavar="PASS",
        help="skip a pass (repeatable)",
    )
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        type=pass_name,
        metavar="PASS",
        help="try a pass the level leaves out (repeatable)",
    )
    parser.add_argument(
        "--report", type=output_file(), metavar="PATH", help="write the report as JSON"
    )
    parser.add_argument(
        "--chart",
        type=output_file(".png"),
        metavar="PATH",
        help="write a PNG chart of latency per pass",
    )


def run_optimize(args: argparse.Namespace) -> int:
    from rich.console import Console

    import bladesmith
    from bladesmith.devices import resolve_device
    from bladesmith.errors import BladesmithError, ModelRunError
    from bladesmith.report import output_console

    device = resolve_device(args.device)
    model, test_data = _model_and_inputs(args)
    config = bladesmith.Config(
        warmup=args.warmup,
        iters=args.iters,
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        progress=True,
        save_as=Path(args.out).suffix if args.out else None,
    )
    try:
        optimized, spec, report = bladesmith.optimize(
            model,
            level=args.level,
            device=device,
            test_data=test_data,
            config=config,
            trust=getattr(args, "trust", False),
        )
    except ModelRunError as error:
        if not isinstance(model, str):  # a built-in model takes any size: not the user's
            raise
        raise BladesmithError(f"{model}: {error}; {image_flags_advice(args)}") from error
    console = output_console()
    report.render(console)
    if args.report:
        report.to_json(args.report)
        console.print(f"report: {args.report}")
    if args.chart:
        report.save_chart(args.chart)
        console.print(f"chart: {args.chart}")
    if args.out:
        with Console(stderr=True).status(f"saving {args.out}"):
            bladesmith.save(optimized, args.out)
        console.print(f"saved: {args.out} (load with bladesmith.load)")
    else:
        from bladesmith.runtimes.formats import save_hint

        console.print(f"to save: {save_hint(spec)}, or --out PATH")
    accurate = (report.accuracy or {}).get("passed", False)
    return 0 if accurate else 1


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from bladesmith.devices import resolve_device

    device = resolve_device(args.device)
    height, width = args.input_size
    photographs = (
        f"{args.batch[0]} photograph(s)"
        if len(args.batch) == 1
        else f"batches of {', '.join(map(str, args.batch))} photographs"
    )
    lines = [
        f"bladesmith demo: {DEFAULT_MODEL} on {device}, {photographs} from "
        f"scikit-image resized to {height}x{width}, level {args.level}.",
    ]
    if device.type == "cpu" and args.iters is None:
        args.warmup = DEMO_CPU_TIMING[0] if args.warmup is None else args.warmup
        args.iters = DEMO_CPU_TIMING[1]
        lines.append(
            f"CPU: each candidate is timed with {args.warmup} warm-up and {args.iters} "
            "runs to keep the demo short (--warmup/--iters for more)."
        )
    Console(stderr=True).print("\n".join(lines), highlight=False)
    return run_optimize(args)


def _model_and_inputs(args: argparse.Namespace):
    """The model to optimize and its test data: photographs of --input-size, --batch of
    them (a list for the built-in detector, one batch tensor for a model file)."""
    from bladesmith.images import sample_images

    check_images_fit(args.batch, args.input_size)
    model = model_or_file(args.model, args.input_size, args.weights)
    batches = [sample_images(size, args.input_size) for size in args.batch]
    return model, [(images,) if isinstance(model, str) else (list(images),) for images in batches]


def run_bench(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from bladesmith._files import write_atomically
    from bladesmith.bench import STATISTIC
    from bladesmith.report import output_console

    loaded = [_load_for_bench(path, args.trust) for path in args.artifacts]
    rows = _time_side_by_side(loaded, args.warmup, args.iters)
    reference = loaded[0]
    for row, (_, outputs, _) in zip(rows[1:], loaded[1:], strict=True):
        row["agreement"] = _agreement((reference[0], reference[1]), (row, outputs))
    table = Table(title="Artifacts", title_justify="left")
    for column in ("Artifact", "Device", "Dtype", "Passes", "Input"):
        table.add_column(column)
    for column in ("p50 ms", "p90 ms", "p99 ms", "Items/s", "Speedup"):
        table.add_column(column, justify="right")
    table.add_column("Outputs against the first's", overflow="fold")
    for row in rows:
        timing = row["timing"]
        table.add_row(
            row["artifact"],
            row["device"],
            row["dtype"],
            ", ".join(row["passes"]) or "-",
            "x".join(map(str, row["input_shape"])),
            f"{timing['p50_ms']:.2f}",
            f"{timing['p90_ms']:.2f}",
            f"{timing['p99_ms']:.2f}",
            f"{timing['throughput']:.1f}",
            _speedup_text(row, rows[0]["timing"]["p50_ms"]),
            row.get("agreement", "(reference)"),
        )
    console = output_console()
    console.print(table)
    console.print(f"Each against the first in alternating rounds: {STATISTIC}.")
    for row in rows:
        settings = ", ".join(f"{name}={value}" for name, value in row["runtime"].items())
        console.print(f"{row['artifact']} ran with {settings}", soft_wrap=True)
    if args.json:
        text = json.dumps(rows, indent=2) + "\n"
        write_atomically(args.json, lambda path: path.write_text(text))
    return 0


def _speedup_text(row: dict, first_p50_ms: float) -> str:
    """A row's speedup, with the first's p50 in its own rounds where that differs from the
    first's row by more than 2% (the table's p50s then do not give the ratio)."""
    text = row["speedup"] or "-"
    then = row.get("first_p50_ms")
    if then is not None and abs(then - first_p50_ms) > 0.02 * first_p50_ms:
        text += f" (the first at {then:.2f} ms in its rounds)"
    return text


def _time_side_by_side(loaded: list, warmup: int | None, iters: int | None) -> list[dict]:
    """Each artifact's row with its timing and its speedup over the first, timed against
    the first in alternating rounds (apart, when it runs on another device); an artifact
    of another input shape is timed apart, with no speedup (None)."""
    from bladesmith import bench
    from bladesmith.config import Config

    (first_row, _, first_call), rows = loaded[0], [row for row, _, _ in loaded]
    device = first_row["device"]
    warmup, iters = Config(warmup=warmup, iters=iters).timing_counts(device.split(":")[0])
    # Every call runs one batch: throughput counts its images.
    counts = dict(warmup=warmup, iters=iters, batch_size=first_row["input_shape"][0])
    if len(loaded) == 1:
        first_row["timing"] = bench.measure(first_call, device=device, **counts).to_dict()
    for row, _, call in loaded[1:]:
        same_shape = row["input_shape"] == first_row["input_shape"]
        if same_shape and row["device"] == device:
            speedup = bench.compare(first_call, call, device=device, **counts)
            first_row.setdefault("timing", speedup.baseline.to_dict())
            row["speedup"] = speedup.describe()
            row["interval"] = [speedup.low, speedup.high]
            row["timing"] = speedup.candidate.to_dict()
            # The first as it ran in these rounds: its p50 in the table is from the first
            # comparison, and the machine may have changed since.
            row["first_p50_ms"] = speedup.baseline.p50_ms
            continue
        if "timing" not in first_row:  # timed once, for every row timed apart
            first_row["timing"] = bench.measure(first_call, device=device, **counts).to_dict()
        own = {**counts, "batch_size": row["input_shape"][0]}
        row["timing"] = bench.measure(call, device=row["device"], **own).to_dict()
        if same_shape:  # another device
            ratio = first_row["timing"]["p50_ms"] / row["timing"]["p50_ms"]
            row["speedup"] = f"{ratio:.2f}x (timed apart)"
        else:  # other work: no ratio means anything
            row["speedup"] = None
    first_row["speedup"] = "1.00x"
    return rows


def _load_for_bench(path: str, trust: bool) -> tuple[dict, object, object]:
    """One artifact, run once on photographs of its input shape: (its table row, its
    outputs, a call that runs it again on them)."""
    import torch

    import bladesmith
    from bladesmith.errors import BladesmithError
    from bladesmith.families import family_named
    from bladesmith.images import sample_images
    from bladesmith.spec import OUTPUT_PADDED

    artifact = bladesmith.load(path, trust=trust)
    spec = artifact.spec
    shape = spec.input_shapes[0]
    if len(spec.input_shapes) != 1 or len(shape) != 4 or shape[1] != 3:
        raise BladesmithError(
            f"bench: {path} takes inputs of shapes {[list(s) for s in spec.input_shapes]}; "
            "bench feeds one batch of images [B, 3, H, W]"
        )
    images = sample_images(shape[0], tuple(shape[2:]), device=artifact.device)
    family = family_named(spec.family) if spec.family and spec.output != OUTPUT_PADDED else None
    inputs = family.user_args(images) if family is not None else (images,)

    @torch.no_grad()
    def call():
        return artifact(*inputs)

    outputs = call()
    row = {
        "artifact": path,
        "device": spec.device,
        "dtype": spec.dtype,
        "passes": list(spec.passes),
        "input_shape": list(shape),
        "runtime": artifact.runtime_settings(),
    }
    return row, outputs, call


def _agreement(reference: tuple[dict, object], other: tuple[dict, object]) -> str:
    """One line: do the outputs match, at the looser tolerance of the two dtypes."""

    from bladesmith.verify import compare_outputs, default_tolerance, precisions

    (reference_row, reference_outputs), (row, outputs) = reference, other
    if reference_row["input_shape"] != row["input_shape"]:
        return "not compared: another input shape"
    computes_in = [precisions.named(r["dtype"]) for r in (reference_row, row)]
    by_metric = next((each.name for each in computes_in if each.by_metric), None)
    if by_metric is not None:
        return f"not compared: a {by_metric} result is judged by its task's metric, not a tolerance"
    rtol, atol = max(
        (default_tolerance(each.dtype) for each in computes_in),
        key=lambda tolerance: tolerance[0],
    )
    comparison = compare_outputs(
        reference_outputs, outputs, rtol=rtol, atol=atol, score_atol=rtol + atol
    )
    return ("match: " if comparison.passed else "DIFFER: ") + comparison.summary()
