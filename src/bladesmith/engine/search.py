"""The search: baseline -> passes -> the fastest accurate candidate, with a report.

The engine knows no pass by name. It copies the user's model (never modifying it),
runs it as given to get the reference outputs and the baseline latency, then offers
each registered pass the best candidate so far: a pass that applies builds a new
candidate, whose outputs on every test input are compared with the reference's and
which is timed; it is kept only if it is within tolerance and at least
``Config.min_speedup`` times faster beyond the noise. A comparison whose interval
straddles that bar is timed again over more rounds before it is decided. Every pass gets
a record, with its reason.

Candidates are verified and timed as they will run: wrapped by the finisher passes that
apply to them (a CUDA graph on the GPU), which a finisher's own record then compares
with the candidate without it. When a detector's outputs fail the comparison, the model
as given also runs under rounding noise (``engine.reference``), once: the
detections that rounding alone flips are not held against a pass.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree

from bladesmith import bench, typed_outputs
from bladesmith._files import first_line
from bladesmith.artifact import OptimizedModule
from bladesmith.bench import Speedup
from bladesmith.config import Config, check_level
from bladesmith.devices import resolve_device, with_index
from bladesmith.engine.heldout import HeldOutCheck
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
    compatibility,
    constant_argument_refusals,
    diagnosis,
    spec_of,
    unreachable_formats,
    with_tried_formats,
)
from bladesmith.engine.saved_speed import SavedSpeed, saved_speed
from bladesmith.engine.state import changed, fingerprint
from bladesmith.errors import BladesmithError, describe
from bladesmith.families import family_of
from bladesmith.ops import libraries
from bladesmith.passes import registry
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped
from bladesmith.progress import Progress
from bladesmith.report import PassRecord, Report, hardware_context, software_context
from bladesmith.runtimes.torchscript import is_torchscript
from bladesmith.spec import SAVE_FORMATS, Spec
from bladesmith.verify import degenerate_reasons

# Times a pass's comparison is re-run when its interval holds the bar but its figure
# clears it: three times the rounds narrow a 99% interval from the rounds' extremes
# to their 8th and 23rd of 30.
UNDECIDED_EXTENSIONS = 2


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
    ``trust``: read a ``.pt2`` file that holds pickled objects or compiled code, which
    run as it loads (refused otherwise: docs/security.md).

    The optimized module takes the same arguments and returns the same structure as
    the model (``Config(output="padded")`` returns a detector's padded tensors).
    """
    config = config or Config.current()
    level = check_level(level)
    device = with_index(resolve_device(device_argument(device, device_type)))
    passes = list(passes) if passes is not None else registry.create_all()
    _check_pass_names(config, passes)
    progress = Progress(config.progress)

    entries = argument_tuples(test_data)
    working, model_info = working_copy(model, device, trust)
    test_args = [pytree.tree_map(lambda x: to_device(x, device), args) for args in entries]
    context = Context(
        device=device,
        level=level,
        config=config,
        example_args=test_args[0],
        test_args=test_args,
        step=progress.step,
    )
    if model_info.pop("was_training"):
        context.notes.append("the model was in training mode; it is optimized in eval mode")
    warmup, iters = config.timing_counts(device.type)
    batch_size = items_per_call(test_args[0])

    finishers = [each for each in passes if each.finisher]
    timing = dict(warmup=warmup, iters=iters, rounds=config.timing_rounds(iters), device=device)

    def finish(candidate: Candidate) -> _Finished:
        return _finished(candidate, finishers, context)

    def time_against(before: _Finished, run: _Finished, label: str) -> Speedup:
        """``run`` (a candidate as it will run, wrapped by its finishers) against
        ``before``, timed in alternating rounds."""
        label += run.where
        with progress.step(f"timing {label}"):
            return bench.compare(
                _callable(before.candidate),
                _callable(run.candidate),
                test_args[0],
                batch_size=batch_size,
                progress=progress.timing_callback(f"timing {label}"),
                undecided=lambda speedup: (
                    speedup.ratio >= config.min_speedup and not speedup.clears(config.min_speedup)
                ),
                max_extensions=UNDECIDED_EXTENSIONS,
                **timing,
            )

    given = Candidate(module=working, device=device, dtype=model_dtype(working))
    with progress.step("running the model as given"):
        with libraries.recording() as dispatched:
            outputs = _reference_outputs(given, context)
            # Traces, exports and files hold no Python class: the passes get the model's
            # dataclasses and NamedTuples as dicts and tuples, the result rebuilds them.
            output_types = typed_outputs.record(outputs[0])
            if output_types is not None:
                given = dataclasses.replace(given, module=typed_outputs.PlainOutputs(working))
                outputs = [typed_outputs.plain(each) for each in outputs]
            reference = Reference(outputs, given, context, family_of(working))
    best, best_run = given, finish(given)
    context.user_operators = frozenset(filter(libraries.is_user_operator, dispatched))
    held_out = HeldOutCheck(reference, given, context, _outputs_on)
    _check_save_as(working, context)
    nothing = degenerate_reasons(reference.outputs, test_args)
    if nothing:
        consent = (
            "passes are kept on it as Config(allow_degenerate=True) asks"
            if config.allow_degenerate
            else "no pass is kept on it (Config(allow_degenerate=True) to keep them anyway)"
        )
        context.notes.append(
            f"Verification has nothing to compare: {'; '.join(nothing)}; {consent}. Give "
            "test inputs on which the model gives finite, non-zero outputs (detections)."
        )
    records: list[PassRecord] = []
    # (candidate, its gain over the model as given, index of its record) of the model as
    # given (-1, always first) and of kept passes that nothing kept later beats: those
    # the result may fall back to. Gains multiply the speedups measured along the way.
    checkpoints: list[tuple[Candidate, float, int]] = [(best, 1.0, -1)]
    for each in passes:
        before = best_run
        if each.name in best_run.finished_by:  # the best was timed in it: compare without
            before = _Finished(best, ())
        record, candidate, run = _try(
            each, best, before, context, reference, held_out, finish, time_against
        )
        records.append(record)
        progress.log(record)
        if record.status == "kept":
            if each.finisher:  # the candidates before it were timed as this one runs
                checkpoints = checkpoints[:1]
            gain = checkpoints[-1][1] * record.speedup
            faster = [c for c in checkpoints[1:] if c[1] > gain]
            checkpoints = [checkpoints[0], *faster, (candidate, gain, len(records) - 1)]
            best, best_run = candidate, run
            context.kept.append(each.name)
        elif before is not best_run:  # it will not wrap the best: that runs without it
            best_run = before
    best = _fastest(checkpoints, records)
    final_held = None
    if best is not given:
        final_held = held_out.check(
            best,
            _outputs(best, context),
            config,
            who="the result",
            waived=_waived(best, passes, config),
        )
        if final_held is not None and not final_held.passed:
            _drop_kept(records, f"dropped at the end: {final_held.line}")
            best = given
    if best is not given:
        with progress.step("timing the result against the model as given"):
            overall = bench.compare(
                _callable(given),
                _callable(best),
                test_args[0],
                batch_size=batch_size,
                # Slower by the median but not beyond the noise: a disturbed round must
                # not throw away what every pass measured; more rounds decide.
                undecided=lambda speedup: speedup.ratio < 1.0 <= speedup.high,
                max_extensions=UNDECIDED_EXTENSIONS,
                **timing,
            )
        if overall.ratio < 1.0:  # never slower than the model as given
            _drop_kept(
                records,
                f"dropped at the end: the result ran at {overall.describe()} of the model "
                "as given, which is returned instead",
            )
            best = given
    if best is given:  # the model's own call path, timed alone: 1.00x by construction
        with progress.step("timing the model as given"):
            alone = bench.measure(
                _callable(given),
                test_args[0],
                batch_size=batch_size,
                warmup=warmup,
                iters=iters,
                device=device,
            )
        overall = bench.same(alone)
    _mark_superseded(records, best)
    doubts = [f"{r.name}: {d}" for r in records for d in r.doubts] + [
        f"the result against the model as given: {d}" for d in overall.doubts
    ]

    with progress.step("verifying the result"):
        final_accuracy = reference.compare(_outputs(best, context), best.dtype, config)
    backend = next((p for p in passes if p.name == best.backend), None)
    spec = spec_of(best, context, backend.saves_as if backend else None)
    spec = dataclasses.replace(spec, output_types=output_types)
    optimized = OptimizedModule.from_candidate(
        best,
        spec=spec,
        output=config.output,
        example_args=best.runner_args(test_args[0]),
        verified_args=[best.runner_args(args) for args in test_args],
    )
    with progress.step("saving the result in each format and loading it back"):
        spec = optimized.spec = with_tried_formats(
            spec,
            optimized,
            context.test_args + held_out.args,
            refused={**_refused_formats(passes, best), **constant_argument_refusals(best, context)},
            judge=_saved_judge(reference, held_out, best, config, _waived(best, passes, config)),
            tolerance=reference.tolerance(best.dtype, config),
        )
    if best is given:
        saved = SavedSpeed(None, None, "the result is the model as given")
    else:
        with progress.step("timing the saved result, reloaded in a new process"):
            saved = saved_speed(
                optimized,
                spec.save_formats,
                _callable(given),
                test_args[0],
                warmup=warmup,
                iters=iters,
                rounds=timing["rounds"],
                batch_size=batch_size,
                device=device,
            )
        doubts += [f"the saved result against the model as given: {d}" for d in saved.doubts]
    progress.done(overall)
    if config.output == "padded" and best.family is None:
        context.notes.append(
            "output='padded' applies to models a family adapts to a fixed-shape pipeline "
            "(bladesmith.families); outputs are the model's own"
        )
    report = Report(
        software_context=software_context(),
        hardware_context=hardware_context(device),
        user_config={"level": level, "device": str(device), **config.to_dict()},
        diagnosis=diagnosis(model_info, context, spec, overall, doubts, saved),
        optimizations=records,
        baseline=overall.baseline,
        optimized=overall.candidate,
        speedup=overall,
        saved=saved,
        accuracy={
            **final_accuracy.to_dict(),
            "held_out": final_held.line if final_held else _unchecked(held_out, best is given),
        },
        model_info={**model_info, "input_shapes": [list(s) for s in spec.input_shapes]},
        compatibility_list=[compatibility(device, spec)],
        tolerance=spec.tolerance,
        model_sdk={"load": "bladesmith.load(path)", "save": spec.save_hint},
    )
    return optimized, spec, report


class _Finished(NamedTuple):
    """A candidate as it will run: wrapped by the finisher passes named."""

    candidate: Candidate
    finished_by: tuple[str, ...]

    @property
    def where(self) -> str:
        """ " in cuda_graph" (its finishers, for reasons and labels), or "" without any."""
        return f" in {' + '.join(self.finished_by)}" if self.finished_by else ""


def _finished(candidate: Candidate, finishers: list[Pass], context: Context) -> _Finished:
    """``candidate`` wrapped by each finisher that applies to it and is not in it yet,
    and their names. The model as given is left as is: it may not survive a capture
    (host synchronisations), which the finisher's own trial reports, if it comes to it."""
    if not candidate.applied:
        return _Finished(candidate, ())
    finished_by = []
    for finisher in finishers:
        if finisher.name in candidate.applied or _skip_reason(finisher, candidate, context):
            continue
        try:
            candidate = finisher.apply(candidate, context)
        except Exception:  # its own trial, later, reports why
            continue
        finished_by.append(finisher.name)
    return _Finished(candidate, tuple(finished_by))


def _try(
    each: Pass,
    best: Candidate,
    before: _Finished,
    context: Context,
    reference: Reference,
    held_out: HeldOutCheck,
    finish: Callable[[Candidate], _Finished],
    time_against: Callable[[_Finished, _Finished, str], Speedup],
) -> tuple[PassRecord, Candidate | None, _Finished | None]:
    """Apply, verify and time one pass against the best candidate so far, as it runs
    (``before``: without the pass, when the pass is a finisher it was timed in). The
    candidate is verified as it is timed and will run, wrapped by its finishers (a CUDA
    graph's capture may pick other convolution algorithms than eager calls). Returns its
    record and, when kept, the candidate and what it was timed as."""
    name, config = each.name, context.config

    def record(status, reason, **fields):
        return PassRecord(name=name, status=status, reason=reason, **fields)

    skip = _skip_reason(each, best, context)
    if skip:
        return record("skipped", skip), None, None
    started = time.perf_counter()
    try:
        with context.step(f"{name}: applying"):
            candidate = each.apply(best, context)
            run = finish(candidate)
        built = f"built in {time.perf_counter() - started:.1f} s"
        with context.step(f"{name}: verifying"):
            outputs = _outputs(run.candidate, context)
            accuracy = reference.compare(outputs, candidate.dtype, config)
            if not accuracy.passed and run.finished_by:
                # Only the wrapped form moves? The finisher is at fault, and its own
                # trial rejects it: judge the candidate without it.
                bare_outputs = _outputs(candidate, context)
                bare = reference.compare(bare_outputs, candidate.dtype, config)
                if bare.passed:
                    run, accuracy, outputs = _Finished(candidate, ()), bare, bare_outputs
    except PassSkipped as error:
        return record("skipped", str(error)), None, None
    except Exception as error:  # a failing pass is reported, never fatal
        return record("failed", describe(error)), None, None
    waived = each.changes_precision and config.disable_fp16_accuracy_check
    if accuracy.degenerate and not config.allow_degenerate:
        reason = (
            f"not kept on a comparison with nothing to compare ({'; '.join(accuracy.degenerate)}"
            f"); Config(allow_degenerate=True) keeps passes on it ({built}; not timed)"
        )
        return record("rejected", reason, accuracy=accuracy), None, None
    if not accuracy.passed and not waived:
        reason = f"outputs moved past tolerance{run.where} ({built}; not timed)"
        return record("rejected", reason, accuracy=accuracy), None, None
    try:
        speedup = time_against(before, run, name)
    except Exception as error:
        return record("failed", f"timing: {describe(error)}", accuracy=accuracy), None, None
    fields = dict(
        pre_run=speedup.baseline.p50_ms,
        post_run=speedup.candidate.p50_ms,
        speedup=speedup.ratio,
        interval=[speedup.low, speedup.high],
        accuracy=accuracy,
        timing=speedup.candidate,
        doubts=list(speedup.doubts),
    )
    check = "accuracy check disabled" if not accuracy.passed else "outputs within tolerance"
    if run.finished_by:
        check += f", both timed{run.where}"
    bar = config.min_speedup
    if speedup.clears(bar):
        reason = f"{speedup.describe()}, {check} ({built})"
    elif each.enabler:
        reason = (
            f"kept at {speedup.describe()}: the passes after it need what it does; "
            f"{check} ({built})"
        )
    elif speedup.ratio >= bar:
        reason = (
            f"{speedup.describe()}: the interval holds the {bar:g}x needed to keep it, so "
            f"the gain is within the noise ({built})"
        )
        return record("rejected", reason, **fields), None, None
    else:
        reason = f"{_below_bar(speedup.ratio)}, below the {bar:g}x needed to keep it ({built})"
        return record("rejected", reason, **fields), None, None
    with context.step(f"{name}: verifying on held-out inputs"):
        held = held_out.check(run.candidate, outputs, config, who=name, waived=waived)
    if held is None and speedup.implausible:
        why = f"{speedup.describe()} is implausible, and no held-out input could check it"
        return record("rejected", f"{why} ({held_out.how})", **fields), None, None
    if held is not None and not held.passed:
        return (
            record("rejected", f"{held.line} ({built}; timed at {speedup.describe()})", **fields),
            None,
            None,
        )
    if held is not None:
        reason += f"; {held.line}"
        if speedup.implausible:
            reason += " (the figure is implausible: kept only as the held-out check passed)"
    return record("kept", reason, **fields), candidate, run


def _below_bar(speedup: float) -> str:
    """A speedup under the bar, truncated to two decimals: 1.0297 is 1.02x, never a
    rounded 1.03x beside "below the 1.03x needed"."""
    return f"{math.floor(speedup * 100) / 100:.2f}x"


def _check_save_as(model, context: Context) -> None:
    """Refuse, before any pass runs, a ``save_as`` format that no result of ``model`` can
    be saved in."""
    save_as = context.config.save_as
    unreachable = unreachable_formats(model, context)
    if save_as in unreachable:
        others = [each for each in SAVE_FORMATS if each not in unreachable]
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


def _skip_reason(each: Pass, candidate: Candidate, context: Context) -> str | None:
    config = context.config
    if each.name in config.exclude:
        return "excluded by Config(exclude=...)"
    if config.save_as in each.refuses_formats:
        return (
            f"the result is to be saved as {config.save_as} (Config(save_as=...), --out), "
            f"which this pass's result cannot be: {each.refuses_formats[config.save_as]}"
        )
    if context.level not in each.levels and each.name not in config.include:
        levels = ", ".join(each.levels)
        return f"not part of level {context.level} (it is in {levels}; or Config(include=...))"
    if context.device.type not in each.devices:
        return f"runs on {', '.join(each.devices)}; the device is {context.device.type}"
    if each.rewrites_modules and is_torchscript(candidate.module):
        return (
            "a TorchScript module's layers cannot be rewritten (the torchscript pass folds "
            "its batch norms: torch.jit.freeze + optimize_for_inference)"
        )
    return each.skip_reason(candidate, context)


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


def _outputs(candidate: Candidate, context: Context) -> list:
    return _outputs_on(candidate, context.test_args)


def _outputs_on(candidate: Candidate, calls: list[tuple]) -> list:
    module = OptimizedModule.from_candidate(candidate)
    return [module(*args) for args in calls]


def _waived(candidate: Candidate, passes: Sequence[Pass], config: Config) -> bool:
    """Whether ``candidate``'s tolerance is waived: a precision pass in it, and
    Config(disable_fp16_accuracy_check=True)."""
    return config.disable_fp16_accuracy_check and any(
        each.changes_precision and each.name in candidate.applied for each in passes
    )


def _unchecked(held_out: HeldOutCheck, given: bool) -> str:
    if given:
        return "not needed: the result is the model as given"
    return f"not checked on held-out inputs ({held_out.how})"


def _saved_judge(reference: Reference, held_out: HeldOutCheck, best: Candidate, config, waived):
    """The judge of a saved format's outputs on the test data and then the held-out
    inputs: the test data's comparison, and, when it passes, the held-out check."""
    count = len(reference.inputs)

    def judge(outputs: list):
        on_test = reference.compare(outputs[:count], best.dtype, config)
        if not on_test.passed or len(outputs) == count:
            return on_test
        return held_out.judge(
            outputs[:count],
            outputs[count:],
            best.dtype,
            config,
            who="the saved file",
            waived=waived,
        )

    return judge


def _reference_outputs(given: Candidate, context: Context) -> list:
    """The model as given on every test input; a model that fails on them is the
    user's input to fix, not a pass's failure."""
    from bladesmith.errors import ModelRunError

    before = fingerprint(given.module)
    try:
        outputs = _outputs(given, context)
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
            _outputs(given, context)
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


def _callable(candidate: Candidate) -> Callable:
    """What ``optimize`` returns for ``candidate``, as it is timed: the model as given is
    its own call path (no wrapper: nothing can be slower than the model itself)."""
    if not candidate.applied:
        module = candidate.module

        def own(*args, **kwargs):
            with torch.no_grad():
                return module(*args, **kwargs)

        return own
    return OptimizedModule.from_candidate(candidate)


def _check_pass_names(config: Config, passes: Sequence[Pass]) -> None:
    known = {each.name for each in passes}
    unknown = (set(config.include) | set(config.exclude)) - known
    if unknown:
        raise ValueError(
            f"Config include/exclude: no pass named {sorted(unknown)}; passes are "
            f"{', '.join(each.name for each in passes)}"
        )
