"""The search: baseline -> passes -> the fastest accurate candidate, with a report.

The engine knows no pass by name. It copies the user's model (never modifying it),
runs it as given to get the reference outputs and the baseline latency, then offers
each registered pass the best candidate so far (``engine.trial``): a pass that applies
builds a new candidate, whose outputs on every test input are compared with the
reference's and which is timed; it is kept only if it is within tolerance and at least
``Config.min_speedup`` times faster beyond the noise. Every pass gets a record, with its
reason. The result is checked on held-out inputs, timed against the model as given,
saved in each format and loaded back (``engine.result`` assembles its spec and report).
When a detector's outputs fail the comparison, the model as given also runs under
rounding noise (``engine.reference``), once: the detections that rounding alone flips
are not held against a pass.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from bladesmith import bench, typed_outputs
from bladesmith._files import first_line
from bladesmith.artifact import OptimizedModule
from bladesmith.bench import Speedup
from bladesmith.config import Config, check_config, check_level
from bladesmith.devices import resolve_device, with_index
from bladesmith.engine.heldout import HeldOutCheck, Verdict
from bladesmith.engine.inputs import (
    argument_tuples,
    device_argument,
    items_per_call,
    model_dtype,
    to_device,
    working_copy,
)
from bladesmith.engine.reference import Reference
from bladesmith.engine.result import (
    constant_argument_refusals,
    report_of,
    spec_of,
    unreachable_formats,
    with_tried_formats,
)
from bladesmith.engine.saved_speed import SavedSpeed, saved_speed
from bladesmith.engine.state import changed, fingerprint
from bladesmith.engine.trial import (
    UNDECIDED_EXTENSIONS,
    Finished,
    Trial,
    as_called,
    outputs_on,
    skip_reason,
    tolerance_waived,
)
from bladesmith.errors import BladesmithError, SettingError
from bladesmith.families import family_of
from bladesmith.ops import libraries
from bladesmith.passes import registry
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.progress import Progress
from bladesmith.report import PassRecord, Report
from bladesmith.runtimes.formats import FORMATS
from bladesmith.spec import Spec
from bladesmith.verify import degenerate_reasons
from bladesmith.verify.heldout import HeldOut, calibration_inputs, source_of


def optimize(
    model,
    level: str = "o1",
    device: str | torch.device = "auto",
    test_data: Sequence | None = None,
    config: Config | None = None,
    *,
    passes: Sequence[Pass] | None = None,
    device_type: str | None = None,
    trust: bool = False,
) -> tuple[OptimizedModule, Spec, Report]:
    """Optimize ``model`` for ``device``; return (optimized module, spec, report).

    ``model``: an ``nn.Module`` (a torchvision detector included), a TorchScript module,
    a ``torch.export`` program, or the path of a TorchScript (``.pt``) or exported
    (``.pt2``) file. It is never modified: the engine works on a copy, in eval mode.
    ``level``: "o0" (no precision change), "o1" (+ fp16/bf16 when accurate), "o2" (+
    longer builds: Inductor max-autotune, Inductor on the CPU).
    ``device``: "auto" (best here), "cuda", "cuda:1", "cpu", ...
    ``test_data``: sample inputs, a list with one entry per call: a tuple of positional
    arguments, or any other value as the single argument (a detector's entry is its
    list of images, or ``(images,)``). The first entry is timed; all are verified.
    ``config``: a ``Config``; default: the innermost ``with Config(...)``, else defaults.
    ``passes``: the passes to try, in order (default: every registered pass).
    ``device_type``: PAI-Blade's name for ``device`` ("gpu", "cpu"): give either.
    ``trust``: read a model file whose loading runs code it brings (TorchScript or a
    torch.export graph outside the operator allowlist, a ``.pt2`` that only torch's
    pickle reader reads), refused otherwise (docs/security.md).

    The optimized module takes the same arguments and returns the same structure as
    the model (``Config(output="padded")`` returns a detector's padded tensors).
    """
    config = check_config(config) if config is not None else Config.current()
    device = with_index(resolve_device(device_argument(device, device_type)))
    passes = list(passes) if passes is not None else registry.create_all()
    _check_pass_names(config, passes)
    progress = Progress(config.progress)
    working, model_info = working_copy(model, device, trust)
    test_args = [
        pytree.tree_map(lambda x: to_device(x, device), args) for args in argument_tuples(test_data)
    ]
    context = Context(
        device, check_level(level), config, test_args[0], test_args, step=progress.step
    )
    context.calibration = functools.cache(lambda: _calibration(config, test_args, device))
    held_out_given = _held_out_given(config, test_args, device)
    if model_info.pop("was_training"):
        context.notes.append("the model was in training mode; it is optimized in eval mode")
    warmup, iters = config.timing_counts(device.type)
    timing = dict(warmup=warmup, iters=iters, rounds=config.timing_rounds(iters), device=device)

    given = Candidate(module=working, device=device, dtype=model_dtype(working))
    with progress.step("running the model as given"):
        with libraries.recording() as dispatched:
            given, reference, output_types = _reference_of(given, working, context)
    context.user_operators = frozenset(filter(libraries.is_user_operator, dispatched))
    _check_save_as(working, context)
    _note_degenerate(reference, context)
    finishers = [each for each in passes if each.finisher]
    held_out = HeldOutCheck(reference, given, context, outputs_on, held_out_given)
    trial = Trial(
        context, reference, held_out, finishers, timing, items_per_call(test_args[0]), progress
    )
    records: list[PassRecord] = []
    best = _fastest(_kept_in_turn(passes, given, trial, records), records)
    best, overall, final_held = _against_given(best, given, passes, trial, records)
    _mark_superseded(records, best)
    doubts = [f"{r.name}: {d}" for r in records for d in r.doubts] + [
        f"the result against the model as given: {d}" for d in overall.doubts
    ]
    with progress.step("verifying the result"):
        final_accuracy = reference.compare(outputs_on(best, test_args), best.dtype, config)
    optimized, spec = _saved_and_reloaded(best, passes, trial, output_types, final_held)
    saved = _saved_timed(optimized, best is given, given, trial)
    doubts += [f"the saved result against the model as given: {d}" for d in saved.doubts]
    progress.done(overall, saved)
    held_line = final_held.line if final_held else _unchecked(held_out, best is given)
    report = report_of(
        model_info,
        context,
        spec,
        overall,
        doubts,
        saved,
        records,
        final_accuracy,
        held_line,
        reference,
        [each.name for each in passes if each.changes_arithmetic and each.name in best.applied],
        {each.name: each.lost_in for each in passes if each.name in best.applied},
    )
    return optimized, spec, report


def _reference_of(
    given: Candidate, working: torch.nn.Module, context: Context
) -> tuple[Candidate, Reference, dict | None]:
    """The model as given run on the test data: the candidate the passes start from, the
    reference they are judged against and the outputs' types (``typed_outputs.record``).
    Traces, exports and files hold no Python class: the passes get the model's dataclasses
    and NamedTuples as dicts and tuples, and the result rebuilds them."""
    outputs = _reference_outputs(given, context)
    output_types = typed_outputs.record(outputs[0])
    if output_types is not None:
        given = dataclasses.replace(given, module=typed_outputs.PlainOutputs(working))
        outputs = [typed_outputs.plain(each) for each in outputs]
    return given, Reference(outputs, given, context, family_of(working)), output_types


def _saved_timed(
    optimized: OptimizedModule, is_given: bool, given: Candidate, trial: Trial
) -> SavedSpeed:
    """The saved result's speed, reloaded in a new process, against the model as given
    rebuilt in one of its own where it can be."""
    if is_given:
        return SavedSpeed(None, None, "the result is the model as given")
    with trial.progress.step("timing the saved result, reloaded in a new process"):
        return saved_speed(
            optimized,
            optimized.spec.save_formats,
            as_called(given),
            trial.context.test_args[0],
            **trial.timing,
            batch_size=trial.batch_size,
            given_module=given.module,
        )


def _note_degenerate(reference: Reference, context: Context) -> None:
    """Say in the diagnosis when the model's outputs give verification nothing to
    compare (all zero, not finite, no detections)."""
    nothing = degenerate_reasons(reference.outputs, context.test_args)
    if not nothing:
        return
    consent = (
        "passes are kept on it as Config(allow_degenerate=True) asks"
        if context.config.allow_degenerate
        else "no pass is kept on it (Config(allow_degenerate=True) to keep them anyway)"
    )
    context.notes.append(
        f"Verification has nothing to compare: {'; '.join(nothing)}; {consent}. Give "
        "test inputs on which the model gives finite, non-zero outputs (detections)."
    )


def _kept_in_turn(
    passes: list[Pass], given: Candidate, trial: Trial, records: list[PassRecord]
) -> list[tuple[Candidate, float, int]]:
    """Each pass tried in turn on the best candidate so far, its record added to
    ``records``. Returns the checkpoints: (candidate, its gain over the model as given,
    index of its record) of the model as given (-1, always first) and of kept passes
    that nothing kept later beats: those the result may fall back to. Gains multiply the
    speedups measured along the way."""
    best, best_run = given, trial.finish(given)
    checkpoints: list[tuple[Candidate, float, int]] = [(best, 1.0, -1)]
    chain = [given]  # every candidate kept, in turn: where a runtime may start instead
    for each in passes:
        before = best_run
        if each.name in best_run.finished_by:  # the best was timed in it: compare without
            before = Finished(best, ())
        record, candidate, run = trial(each, best, before)
        if record.status == "skipped" and each.saves_as:
            record, candidate, run = _on_an_earlier_result(each, chain, record, trial, before)
        records.append(record)
        trial.progress.log(record)
        if record.status == "kept":
            if each.finisher:  # the candidates before it were timed as this one runs
                checkpoints = checkpoints[:1]
            gain = checkpoints[-1][1] * record.speedup
            faster = [c for c in checkpoints[1:] if c[1] > gain]
            checkpoints = [checkpoints[0], *faster, (candidate, gain, len(records) - 1)]
            best, best_run = candidate, run
            chain.append(candidate)
            trial.context.kept.append(each.name)
        elif before is not best_run:  # it will not wrap the best: that runs without it
            best_run = before
    return checkpoints


def _on_an_earlier_result(
    each: Pass, chain: list[Candidate], skipped: PassRecord, trial: Trial, before: Finished
) -> tuple[PassRecord, Candidate | None, Finished | None]:
    """A runtime that cannot take the best so far (an operator or a dtype a pass kept
    brought in: OpenVINO and bladesmith's Winograd kernel) tried on the latest kept
    result it can take, timed against the best: the fastest runtime wins, whichever
    passes it leaves out. The skip stands where no kept result takes it, or where the
    pass took the best and skipped only once applied (nothing earlier would change it)."""
    best = chain[-1]
    if skip_reason(each, best, trial.context) is None:
        return skipped, None, None
    for earlier in reversed(chain[:-1]):
        if skip_reason(each, earlier, trial.context) is None:
            break
    else:
        return skipped, None, None
    record, candidate, run = trial(each, earlier, before)
    if record.status == "kept":  # the passes kept after ``earlier`` are not in the result
        kept = trial.context.kept
        kept[:] = [name for name in kept if name in earlier.applied]
    left_out = [name for name in best.applied if name not in earlier.applied]
    record.reason = (
        f"tried on the result without {', '.join(left_out)} (the best so far: "
        f"{skipped.reason}): {record.reason}"
    )
    return record, candidate, run


def _against_given(
    best: Candidate, given: Candidate, passes: list[Pass], trial: Trial, records: list
) -> tuple[Candidate, Speedup, Verdict | None]:
    """The result checked on the held-out inputs and timed against the model as given:
    (the result, falling back to the model as given when it fails either; its speedup;
    the held-out check, None when none was made)."""
    progress, context = trial.progress, trial.context
    final_held = None
    if best is not given:
        final_held = trial.held_out.check(
            best,
            outputs_on(best, context.test_args),
            context.config,
            who="the result",
            waived=tolerance_waived(best, passes, context.config),
        )
        if final_held is not None and not final_held.passed:
            _drop_kept(records, f"dropped at the end: {final_held.line}")
            best = given
    if best is not given:
        with progress.step("timing the result against the model as given"):
            overall = bench.compare(
                as_called(given),
                as_called(best),
                context.test_args[0],
                batch_size=trial.batch_size,
                # Slower by the median but not beyond the noise: a disturbed round must
                # not throw away what every pass measured; more rounds decide.
                undecided=lambda speedup: speedup.ratio < 1.0 <= speedup.high,
                max_extensions=UNDECIDED_EXTENSIONS,
                **trial.timing,
            )
        if overall.ratio >= 1.0:  # never slower than the model as given
            return best, overall, final_held
        _drop_kept(
            records,
            f"dropped at the end: the result ran at {overall.describe()} of the model "
            "as given, which is returned instead",
        )
    with progress.step("timing the model as given"):  # its own call path: 1.00x
        alone = bench.measure(
            as_called(given),
            context.test_args[0],
            batch_size=trial.batch_size,
            warmup=trial.timing["warmup"],
            iters=trial.timing["iters"],
            device=context.device,
        )
    return given, bench.same(alone), final_held


def _saved_and_reloaded(
    best: Candidate,
    passes: list[Pass],
    trial: Trial,
    output_types: dict | None,
    held: Verdict | None,
) -> tuple[OptimizedModule, Spec]:
    """The optimized module and its spec, whose save formats are those that saved,
    loaded back and judged on the test data and the held-out inputs passed (its tolerance
    the task metric's verdict, ``held``, where that judged the result): a detector's
    module saved, in the formats it does not save in itself, through its family's
    fixed-shape pipeline (``Pass.saving_form``)."""
    optimized, spec = _tried_formats(best, passes, trial, output_types, held)
    deployable = _saving_form(best, trial.context)
    # A format that holds only its own pass's result (.ptc, .ov) is refused to the
    # pipeline as it was to the module: not worth trying again.
    missing = [
        suffix
        for suffix, each in FORMATS.items()
        if suffix not in spec.save_formats and not each.only_its_pass
    ]
    if deployable is None or not missing:
        return optimized, spec
    through, _ = _tried_formats(deployable, passes, trial, output_types, held, only=missing)
    added = [each for each in through.spec.save_formats if each not in spec.save_formats]
    # A format that save builds and checks then (a .pt2): from the pipeline, which
    # torch.export takes whole, where the module would hand it data-dependent shapes.
    untried = [each for each in through.spec.untried_formats if each in missing]
    if not added and not untried:
        return optimized, spec
    optimized.saved_forms = dict.fromkeys([*added, *untried], through)
    why = "; ".join(f"{each}: {spec.refused_formats.get(each, 'not tried')}" for each in added)
    trial.context.notes.append(
        f"Saved as {', '.join([*added, *untried])} through the {deployable.family.name} "
        "fixed-shape pipeline around the result's module (its weights as the passes left "
        "them)" + (f", which the module itself does not save as ({why})" if why else "")
    )
    optimized.spec = dataclasses.replace(
        spec,
        save_formats=(*spec.save_formats, *added),
        untried_formats={**spec.untried_formats, **through.spec.untried_formats},
        refused_formats={k: v for k, v in spec.refused_formats.items() if k not in added},
    )
    return optimized, optimized.spec


def _saving_form(best: Candidate, context: Context) -> Candidate | None:
    """The first form of ``best`` that a registered pass saves it through, or None."""
    forms = (each.saving_form(best, context) for each in registry.create_all())
    return next((form for form in forms if form is not None), None)


def _tried_formats(
    best: Candidate,
    passes: list[Pass],
    trial: Trial,
    output_types: dict | None,
    held: Verdict | None,
    only: list[str] | None = None,
) -> tuple[OptimizedModule, Spec]:
    """``best`` as an optimized module whose spec lists the formats it saved in (of
    ``only``, when given), loaded back and whose outputs passed."""
    context, config = trial.context, trial.context.config
    tolerance = trial.reference.tolerance(best.dtype, config)
    if best.computes_in.by_metric and held is not None:
        tolerance = {**(held.metric or {}), "why": f"judged by the task's metric: {held.line}"}
    backend = next((p for p in passes if p.name == best.backend), None)
    spec = spec_of(best, context, backend.saves_as if backend else None)
    kept = [each for each in spec.save_formats if only is None or each in only]
    spec = dataclasses.replace(spec, output_types=output_types, save_formats=tuple(kept))
    optimized = OptimizedModule.from_candidate(
        best,
        spec=spec,
        output=config.output,
        example_args=best.runner_args(context.test_args[0]),
        verified_args=[best.runner_args(args) for args in context.test_args],
    )
    with trial.progress.step("saving the result in each format and loading it back"):
        optimized.spec = with_tried_formats(
            spec,
            optimized,
            context.test_args + trial.held_out.args(best.computes_in.by_metric),
            refused={**_refused_formats(passes, best), **constant_argument_refusals(best, context)},
            judge=_saved_judge(trial, best, tolerance_waived(best, passes, config)),
            tolerance=tolerance,
            notes=context.notes,
        )
    return optimized, optimized.spec


def _check_save_as(model, context: Context) -> None:
    """Refuse, before any pass runs, a ``save_as`` format that no result of ``model`` can
    be saved in."""
    save_as = context.config.save_as
    if save_as is not None and save_as not in FORMATS:
        raise SettingError(f"Config.save_as: expected one of {', '.join(FORMATS)}, got {save_as!r}")
    unreachable = unreachable_formats(model, context)
    if save_as in unreachable:
        # A format that holds only its own pass's result (.ptc, .ov) is no way round:
        # it is there only where that pass is kept.
        others = [
            suffix
            for suffix, each in FORMATS.items()
            if suffix not in unreachable and not each.only_its_pass
        ]
        instead = f"; save as {' or '.join(others)}" if others else ""
        raise BladesmithError(
            f"the result is to be saved as {save_as} (Config(save_as=...), --out), which it "
            f"cannot be: {unreachable[save_as]}{instead}"
        )


def _refused_formats(passes: list[Pass], best: Candidate) -> dict[str, str]:
    """The save formats that a pass in the result refuses (suffix: why), the first
    reason kept where several refuse one."""
    refused: dict[str, str] = {}
    for each in passes:
        if each.name in best.applied:
            for suffix, why in each.refuses_formats.items():
                refused.setdefault(suffix, why)
    return refused


def _fastest(checkpoints: list, records: list[PassRecord]) -> Candidate:
    """The checkpoint with the largest gain. Normally the last, as a pass is kept only
    when faster; but an enabler is kept even when slower, and if nothing after it paid
    off, an earlier checkpoint wins: the passes kept after it are dropped, and say so."""
    candidate, gain, index = max(checkpoints, key=lambda checkpoint: checkpoint[1])
    last = checkpoints[-1][1]
    _drop_kept(
        records[index + 1 :],
        f"dropped at the end: the result is faster without it ({gain:.2f}x the model as "
        f"given against {last:.2f}x with it, from the speedups measured along the way)",
    )
    return candidate


def _drop_kept(records: list[PassRecord], why: str) -> None:
    for record in records:
        if record.status == "kept":
            record.status = "rejected"
            record.reason += f"; {why}"


def _mark_superseded(records: list[PassRecord], final: Candidate) -> None:
    """A kept pass whose work a later pass replaced (another backend) says so."""
    for record in records:
        if record.status == "kept" and record.name not in final.applied:
            record.reason += f"; superseded by {final.backend}"


def _calibration(config: Config, test_args: list[tuple], device) -> tuple[list[tuple], str]:
    """The inputs a quantizing pass calibrates on and what they are:
    ``Config.calibration_data``, else derived from the test data (never the held-out
    inputs, nor the test inputs the verdict uses)."""
    if config.calibration_data is None:
        derived = calibration_inputs(test_args)
        return derived.args, derived.how
    args = _given_inputs(config.calibration_data, "calibration_data", device)
    return args, f"{len(args)} given by Config.calibration_data"


def _held_out_given(config: Config, test_args: list[tuple], device) -> HeldOut | None:
    """``Config.held_out_data`` as held-out inputs, each with the test entry of its
    signature (whose measured tolerances judge it); None where it is not set."""
    if config.held_out_data is None:
        return None
    args = _given_inputs(config.held_out_data, "held_out_data", device)
    sources = [source_of(each, test_args) for each in args]
    if None in sources:
        raise SettingError(
            f"Config.held_out_data: entry {sources.index(None)} matches no test_data entry "
            "in structure, shapes and dtypes: give held-out inputs shaped like the test data"
        )
    return HeldOut(args, sources, f"{len(args)} given by Config.held_out_data")


def _given_inputs(data, setting: str, device) -> list[tuple]:
    """``Config.<setting>``'s inputs as argument tuples on ``device``."""
    try:
        entries = argument_tuples(data)
    except ValueError as error:
        raise SettingError(f"Config.{setting}: " + str(error).removeprefix("test_data: ")) from None
    return [pytree.tree_map(lambda x: to_device(x, device), each) for each in entries]


def _unchecked(held_out: HeldOutCheck, given: bool) -> str:
    if given:
        return "not needed: the result is the model as given"
    return f"not checked on held-out inputs ({held_out.how})"


def _saved_judge(trial: Trial, best: Candidate, waived: bool) -> Callable:
    """The judge of a saved format's outputs on the test data and then the held-out
    inputs: the test data's comparison, and, when it passes (or the task's metric judges
    the result), the held-out check."""
    reference, config = trial.reference, trial.context.config
    count = len(reference.inputs)

    by_metric = best.computes_in.by_metric  # its tensors' tolerance does not apply

    def judge(outputs: list):
        on_test = reference.compare(outputs[:count], best.dtype, config)
        if (not on_test.passed and not by_metric) or len(outputs) == count:
            return on_test
        return trial.held_out.judge(
            outputs[:count],
            outputs[count:],
            best.dtype,
            config,
            who="the saved file",
            waived=waived,
            by_metric=by_metric,
        )

    return judge


def _reference_outputs(given: Candidate, context: Context) -> list:
    """The model as given on every test input; a model that fails on them is the
    user's input to fix, not a pass's failure."""
    from bladesmith.errors import ModelRunError

    before = fingerprint(given.module)
    try:
        outputs = outputs_on(given, context.test_args)
    except Exception as error:
        error = _with_message(error, given, context)
        no_kernel = libraries.kernel_error(error)  # not the inputs' fault
        if no_kernel is not None:
            raise no_kernel from error
        shapes = [
            list(x.shape)
            for x in pytree.tree_leaves(context.example_args)
            if isinstance(x, torch.Tensor)
        ]
        raise ModelRunError(
            f"the model as given failed on the test inputs (tensors of shapes {shapes}): "
            f"{first_line(error)}"
        ) from error
    _check_state_kept(given, context, before)
    return outputs


def _with_message(error: Exception, given: Candidate, context: Context) -> Exception:
    """``error``, or, when it lost its message, the error the model raises outside
    bladesmith's dispatch modes. The operator recording that the reference run is made
    under (``libraries.recording``) routes each operator through Python, and TorchScript's
    interpreter then keeps only an empty ``RuntimeError:`` of what the operator raised
    (a 1-channel model given 3 channels said nothing else)."""
    from torch.utils._python_dispatch import _disable_current_modes

    if not first_line(error).endswith(":"):
        return error
    try:
        with _disable_current_modes():
            outputs_on(given, context.test_args)
    except Exception as plain:
        return plain
    return error


def _check_state_kept(given: Candidate, context: Context, before: dict) -> None:
    """Refuse a model whose calls change its parameters or buffers: every run of it would
    answer differently, so no pass could be verified against it, nor timed (before, such
    a model's counter came back advanced by every run optimize made, and the drift read
    as rounding). A change on the first calls only (a lazy layer, a cache built once) is
    allowed when one more call changes nothing."""
    from bladesmith.errors import StatefulModelError

    after = fingerprint(given.module)
    if not changed(before, after):
        return
    OptimizedModule.from_candidate(given)(*context.example_args)
    names = changed(after, fingerprint(given.module))
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise StatefulModelError(
        f"the model changes its own {shown} each time it is called, so its outputs depend "
        "on how often it ran: bladesmith cannot verify or time such a model; make forward "
        "leave its parameters and buffers alone (put the model in eval mode, keep a "
        "counter or cache outside the module) and optimize again"
    )


def _check_pass_names(config: Config, passes: Sequence[Pass]) -> None:
    known = {each.name for each in passes}
    unknown = (set(config.include) | set(config.exclude)) - known
    if unknown:
        raise SettingError(
            f"Config include/exclude: no pass named {sorted(unknown)}; passes are "
            f"{', '.join(each.name for each in passes)}"
        )
