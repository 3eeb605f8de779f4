"""What ``optimize`` returns besides the module: the spec of the result (the formats it
is saved in, and why others are not) and the report of the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from bladesmith import bench
from bladesmith.bench import Speedup
from bladesmith.engine.saved_formats import try_formats
from bladesmith.onnx.exporter import held_constants
from bladesmith.passes import registry
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context
from bladesmith.report import PassRecord, Report, hardware_context, software_context
from bladesmith.runtimes import torchscript
from bladesmith.runtimes.built_for import tensors_in
from bladesmith.runtimes.formats import FORMATS, in_order, save_hint
from bladesmith.runtimes.torchscript import is_torchscript
from bladesmith.spec import OUTPUT_AS_MODEL, OUTPUT_PADDED, Spec


def spec_of(best: Candidate, context: Context, saves_as: str | None) -> Spec:
    """The spec of ``best``; ``saves_as``: the save format of what its backend runs."""
    if best.family is not None:
        output = OUTPUT_PADDED if context.config.output == "padded" else best.family.user_output
    else:
        output = OUTPUT_AS_MODEL
    inputs = tensors_in(best.runner_args(context.example_args))
    formats, left_out = _save_formats(best, context, saves_as)
    return Spec(
        device=str(context.device),
        dtype=best.computes_in.name,
        input_shapes=tuple(tuple(x.shape) for x in inputs),
        input_dtypes=tuple(str(x.dtype).removeprefix("torch.") for x in inputs),
        input_ranges=_integer_ranges(best, context),
        output=output,
        passes=best.applied,
        backend=best.backend,
        save_formats=tuple(formats),
        family=best.family.name if best.family is not None else None,
        refused_formats=left_out,
    )


def _integer_ranges(best: Candidate, context: Context) -> tuple:
    """Per input of the runner, an integer input's lowest and highest value over the test
    data (token ids, lengths: a server's test rows stay where the model was verified);
    None for the others."""
    columns = zip(*(tensors_in(best.runner_args(args)) for args in context.test_args))
    return tuple(_range(column) for column in columns)


def _range(column: tuple[torch.Tensor, ...]) -> tuple[int, int] | None:
    first = column[0]
    if first.is_floating_point() or first.is_complex() or first.dtype == torch.bool:
        return None
    if any(x.numel() == 0 for x in column):  # no values to take a range of
        return None
    return min(int(x.min()) for x in column), max(int(x.max()) for x in column)


def _save_formats(
    best: Candidate, context: Context, saves_as: str | None
) -> tuple[list[str], dict[str, str]]:
    """The formats ``save`` can write, the one closest to what runs first, and those left
    out (suffix: why; what the user's operators rule out is noted in the report too)."""
    left_out = _kind_refusals(best.module, context.device)
    for suffix, why in _operator_refusals(context.user_operators).items():
        if suffix not in left_out:
            left_out[suffix] = why
            context.notes.append(f"not saved as {suffix}: {why}")
    for suffix, each in FORMATS.items():
        if each.only_its_pass and saves_as != suffix and suffix not in left_out:
            left_out[suffix] = (
                f"it holds only what its own pass builds, and this result runs as {best.backend}"
            )
    formats = [each for each in in_order(context.device) if each not in left_out]
    if saves_as in formats:  # what the backend runs comes first
        formats.remove(saves_as)
        formats.insert(0, saves_as)
    return formats, left_out


def unreachable_formats(module, context: Context) -> dict[str, str]:
    """The save formats that no result of ``module`` can be written in (suffix: why):
    what the model is, the device and the user's operators decide it, all known once the
    model as given has run."""
    return {
        **_operator_refusals(context.user_operators),
        **_kind_refusals(module, context.device),
    }


def _kind_refusals(module, device: torch.device) -> dict[str, str]:
    refusals = {suffix: each.refuses(module, device) for suffix, each in FORMATS.items()}
    return {suffix: why for suffix, why in refusals.items() if why}


def _operator_refusals(operators) -> dict[str, str]:
    refusals = {suffix: each.refuses_operators(operators) for suffix, each in FORMATS.items()}
    return {suffix: why for suffix, why in refusals.items() if why}


def constant_argument_refusals(best: Candidate, context: Context) -> dict[str, str]:
    """The formats refused because the test data passes non-tensor arguments (suffix:
    why): a trace cannot take them. A TorchScript model saves as itself; an ONNX export
    records them and refuses other values; torch.export checks them on every call."""
    constants = held_constants(best.module, best.runner_args(context.example_args))
    if not constants or is_torchscript(best.module):
        return {}
    return {
        torchscript.SUFFIX: f"the test data passes non-tensor arguments "
        f"({', '.join(constants)}), which a trace cannot take (torch.export and an ONNX "
        "export keep them as constants that they check on every call)"
    }


def with_tried_formats(
    spec: Spec,
    optimized,
    test_args: list[tuple],
    *,
    refused: dict[str, str],
    judge: Callable,
    tolerance: dict,
    notes: list[str] | None = None,
) -> Spec:
    """``spec`` with its save formats tried: those saved, loaded back and whose outputs
    ``judge`` passed on ``test_args`` stay listed. A format that takes minutes to build
    (an AOTInductor package) is left untried, for ``save`` to check; ``refused`` ones
    (suffix: why) are not tried. ``tolerance`` is what the outputs were judged at; a
    format that compiles (``Format.build_note``) gets its build time in ``notes``."""
    untried = {
        suffix: f"not tried during optimize (a {FORMATS[suffix].description} takes minutes "
        "to build): bladesmith.save builds it, loads it back and checks its outputs"
        for suffix in spec.save_formats
        if FORMATS[suffix].build_cost == "minutes"
    }
    refused = {
        suffix: why
        for suffix, why in {**refused, **_dtype_refusals(spec)}.items()
        if suffix in spec.save_formats
    }
    formats = [each for each in spec.save_formats if each not in untried and each not in refused]
    built: dict[str, float] = {}
    tried, failed = try_formats(optimized, formats, test_args, judge, built)
    for suffix, seconds in built.items():
        if FORMATS[suffix].build_note and notes is not None:
            notes.append(f"{suffix} built in {seconds:.1f} s ({FORMATS[suffix].build_note}).")
    return dataclasses.replace(
        spec,
        save_formats=tried,
        untried_formats=untried,
        refused_formats={**spec.refused_formats, **refused, **failed},
        tolerance=tolerance,
    )


def _dtype_refusals(spec: Spec) -> dict[str, str]:
    """The formats that a result computing in ``spec.dtype`` cannot be saved in (suffix:
    why), as the passes that compute in that dtype declare them, naming those kept (a
    model given in that dtype refuses them too). A pass that builds a runner (OpenVINO,
    in bf16 on a CPU with bf16) refuses formats for its runner, not for the dtype: it
    counts only where the result kept it."""
    computing = [
        each
        for each in registry.create_all()
        if each.computes_in is not None
        and each.computes_in.name == spec.dtype
        and (each.saves_as is None or each.name in spec.passes)
    ]
    refused: dict[str, str] = {}
    for each in computing:
        for suffix, why in each.refuses_formats.items():
            refused.setdefault(suffix, why)
    names = {each.name for each in computing}
    kept = [name for name in spec.passes if name in names] or [f"a {spec.dtype} pass"]
    return {
        suffix: f"{spec.dtype} was kept ({', '.join(kept)}), and {why}"
        for suffix, why in refused.items()
    }


def report_of(
    model_info: dict,
    context: Context,
    spec: Spec,
    overall: Speedup,
    doubts: list[str],
    saved,
    records: list[PassRecord],
    accuracy,
    held_out: str,
    reference,
    changed_arithmetic: list[str],
    lost_in: dict[str, dict[str, str]],
) -> Report:
    """The report of a run: the result ``spec``, timed at ``overall`` against the model
    as given (``saved``: the saved result's speed), the passes' ``records``, the result's
    ``accuracy`` (a ``verify.Comparison``), what its ``held_out`` check said and whether
    the ``reference`` (``engine.reference.Reference``) could verify anything
    (``changed_arithmetic``: the passes in the result that change the arithmetic;
    ``lost_in``: {kept pass: the formats that lose its gain, ``Pass.lost_in``})."""
    if context.config.output == "padded" and spec.family is None:
        context.notes.append(
            "output='padded' applies to models a family adapts to a fixed-shape pipeline "
            "(bladesmith.families); outputs are the model's own"
        )
    return Report(
        software_context=software_context(),
        hardware_context=hardware_context(context.device),
        user_config={
            "level": context.level,
            "device": str(context.device),
            **context.config.to_dict(),
            # What the user gave, in words: a function's name, how many inputs.
            "metric": getattr(context.config.metric, "__name__", context.config.metric),
            **{
                name: None if data is None else f"{len(data)} entries"
                for name in ("calibration_data", "held_out_data")
                for data in [getattr(context.config, name)]
            },
        },
        diagnosis=_diagnosis(
            model_info,
            context,
            spec,
            overall,
            doubts,
            saved,
            _not_verified(reference, changed_arithmetic),
            lost_in,
        ),
        optimizations=records,
        baseline=overall.baseline,
        optimized=overall.candidate,
        speedup=overall,
        saved=saved,
        accuracy={
            **accuracy.to_dict(),
            "held_out": held_out,
            "verified": not reference.unverifiable,
            "not_verified": reference.unverifiable,
            "self_agreement": reference.self_agreement,
        },
        model_info={**model_info, "input_shapes": [list(s) for s in spec.input_shapes]},
        compatibility_list=[_compatibility(context.device, spec)],
        tolerance=spec.tolerance,
        model_sdk={"load": "bladesmith.load(path)", "save": save_hint(spec)},
    )


def _not_verified(reference, kept: list[str]) -> str:
    """The headline of a run whose test inputs cannot verify a change of arithmetic,
    what was done about it (``kept``: the passes in the result that change it) and what
    to do; "" when they can."""
    if not reference.unverifiable:
        return ""
    config = reference.context.config
    if kept:
        done = f"{', '.join(kept)} kept unverified" + (
            ", as Config(allow_unverified=True) asks" if config.allow_unverified else ""
        )
    else:
        done = "no pass that changes the arithmetic was kept" + (
            "" if config.allow_unverified else " (Config(allow_unverified=True) keeps them)"
        )
    return (
        f"NOT VERIFIED on these inputs: {reference.unverifiable}; {done}. Give real inputs "
        "as test_data (photographs of what the model is for) and the model its trained "
        "weights, on which its detections do not hinge on rounding, and optimize again."
    )


def _diagnosis(
    info: dict,
    context: Context,
    spec: Spec,
    overall: Speedup,
    doubts: list[str],
    saved,
    not_verified: str,
    lost_in: dict[str, dict[str, str]],
) -> dict:
    """The report's diagnosis; ``saved``: the saved result's speed (``SavedSpeed``);
    ``not_verified``: why the test inputs verify nothing, its headline; ``lost_in``: what
    each kept pass's gain is lost in (``format_losses``)."""
    kept = ", ".join(spec.passes) or "no pass (the result is the model as given)"
    lines = [
        not_verified,
        headline(spec, overall, saved),
        format_losses(spec, overall, saved, lost_in),
        f"{info['name']} ({info['format']}, {info['parameters'] / 1e6:.1f}M parameters) on "
        f"{context.device}, level {context.level}.",
        *context.notes,
        f"Tolerance: {spec.tolerance['why']}." if spec.tolerance else "",
        f"Kept {kept}: {overall.baseline.p50_ms:.2f} ms -> {overall.candidate.p50_ms:.2f} ms "
        f"(p50) in this process; runs as {spec.backend} in {spec.dtype}.",
        f"Timing: {bench.STATISTIC}.",
    ]
    if doubts:
        lines.append("Figures in doubt (not to be taken as fact): " + "; ".join(doubts) + ".")
    return {
        "message": "\n".join(line for line in lines if line),
        "notes": list(context.notes),
        "speedup": overall.ratio,
        "interval": [overall.low, overall.high],
        "saved": saved.to_dict(),
        "statistic": bench.STATISTIC,
        "doubts": doubts,
        "verified": not not_verified,
    }


def headline(spec: Spec, overall: Speedup, saved) -> str:
    """The report's first figure: the saved artifact's, reloaded in a new process
    (``saved``, a ``SavedSpeed``); the in-process figure second. A result that saves in
    no format says so first."""
    here = f"in this process {overall.describe()}"
    if not spec.save_formats:
        refused = "; ".join(f"{suffix}: {why}" for suffix, why in spec.refused_formats.items())
        untried = ", ".join(spec.untried_formats)
        return (
            f"NOTHING SAVES: no format saved and loaded back with the model's outputs, so no "
            f"checked file keeps this result ({here}): {refused}"
            + (f"; untried: {untried} (bladesmith.save builds it and checks it)" if untried else "")
            + "."
        )
    if not saved.measured:
        return f"The artifact: {saved.describe()}; {here}."
    return (
        f"The artifact, saved as {saved.suffix} and reloaded in a new process: "
        f"{saved.speedup.describe()} (the model as given timed {saved.given}); {here}."
    )


def format_losses(spec: Spec, overall: Speedup, saved, lost_in: dict[str, dict[str, str]]) -> str:
    """What the artifact's format (``saved.suffix``, else the first saved) loses of the
    result's gain, in words: the kept passes whose gain it does not hold (``lost_in``:
    {pass: its ``Pass.lost_in``}) and the format that keeps them, or, with no pass to
    name, that the saved file measured slower than the result in this process beyond
    the noise; "" when it loses nothing."""
    suffix = saved.suffix or (spec.save_formats[0] if spec.save_formats else None)
    losing = {
        name: formats[suffix]
        for name, formats in lost_in.items()
        if name in spec.passes and suffix in formats
    }
    figures = (
        f"{saved.speedup.describe()} saved against {overall.describe()} in this process"
        if saved.measured
        else ""
    )
    if not losing:
        if saved.measured and saved.speedup.high < overall.low:
            return (
                f"The saved {suffix} runs slower than the result does in this process "
                f"({figures}): part of the gain lives only in this process."
            )
        return ""
    why = "; ".join(f"{name}: {reason}" for name, reason in losing.items())
    keeping = [
        each
        for each in FORMATS
        if each != suffix and not any(each in lost_in[name] for name in losing)
    ]
    saved_keeping = [each for each in keeping if each in spec.save_formats]
    if saved_keeping:
        keep = saved_keeping[0]
        keep = f'{keep} keeps it: save as {keep} (bladesmith.save(optimized, "model{keep}"))'
    else:
        refused = [
            f"{each}, refused here ({spec.refused_formats[each]})"
            for each in keeping
            if each in spec.refused_formats
        ]
        keep = "the format that would keep it, " + "; ".join(refused) if refused else ""
        keep = keep or "no format keeps it"
    return (
        f"Saved as {suffix}, the artifact loses the gain of {', '.join(losing)} ({why})"
        + (f": {figures}" if figures else "")
        + f"; {keep}."
    )


def _compatibility(device: torch.device, spec: Spec) -> dict:
    entry = {
        "device_type": {"cuda": "gpu"}.get(device.type, device.type),
        "torch": f">={torch.__version__.split('+')[0]} (the version that built it)",
        "dtype": spec.dtype,
        "save_formats": list(spec.save_formats),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        entry["microarchitecture"] = torch.cuda.get_device_name(device)
        entry["compute_capability"] = f"{major}.{minor} (kernels are built for it)"
    return entry
