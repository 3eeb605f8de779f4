"""optimize(): baseline -> passes -> the fastest accurate candidate, with a report.

The engine knows no pass by name. It copies the user's model (never modifying it),
runs it as given to get the reference outputs and the baseline latency, then offers
each registered pass the best candidate so far: a pass that applies builds a new
candidate, whose outputs on every test input are compared with the reference's and
which is timed; it is kept only if it is within tolerance and at least
``Config.min_speedup`` times faster. Every pass gets a record, with its reason.

Candidates are verified and timed as they will run: wrapped by the finisher passes that
apply to them (a CUDA graph on the GPU), which a finisher's own record then compares
with the candidate without it. When a detector's outputs fail the comparison, the model
as given also runs under rounding noise (``verify.reference_under_noise``), once: the
detections that rounding alone flips are not held against a pass.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from bladesmith.artifact import OptimizedModule
from bladesmith.bench import Timing, measure
from bladesmith.config import Config, check_level
from bladesmith.devices import resolve_device, with_index
from bladesmith.passes import registry
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped
from bladesmith.report import PassRecord, Report, hardware_context, software_context
from bladesmith.spec import (
    AOTI_SUFFIX,
    ONNX_SUFFIX,
    OUTPUT_AS_MODEL,
    OUTPUT_DETECTIONS,
    OUTPUT_PADDED,
    TORCHSCRIPT_SUFFIX,
    Spec,
)
from bladesmith.verify import (
    Comparison,
    compare_outputs,
    contains_detections,
    default_tolerance,
    detection_score_tolerance,
    reference_under_noise,
)

_MAX_ERROR_CHARS = 400


def optimize(
    model,
    level: str = "o1",
    device: str | torch.device = "auto",
    test_data: Sequence | None = None,
    config: Config | None = None,
    *,
    passes: Sequence[Pass] | None = None,
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

    The optimized module takes the same arguments and returns the same structure as
    the model (``Config(output="padded")`` returns a detector's padded tensors).
    """
    config = config or Config.current()
    level = check_level(level)
    device = with_index(resolve_device(device))
    passes = list(passes) if passes is not None else registry.create_all()
    _check_pass_names(config, passes)
    progress = _Progress(config.progress if config.progress is not None else sys.stderr.isatty())

    entries = _entries(test_data)
    working, model_info = _working_copy(model, device)
    test_args = [pytree.tree_map(lambda x: _to(x, device), args) for args in entries]
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
    batch_size = _batch_size(test_args[0])

    finishers = [each for each in passes if each.finisher]

    def finish(candidate: Candidate) -> _Finished:
        return _finished(candidate, finishers, context)

    def time_candidate(run: _Finished, label: str) -> _Timed:
        """The timing of ``run``: a candidate as it will run, wrapped by its finishers."""
        label += run.where
        with progress.step(f"timing {label}"):
            timing = measure(
                OptimizedModule.from_candidate(run.candidate),
                test_args[0],
                warmup=warmup,
                iters=iters,
                device=device,
                batch_size=batch_size,
                progress=progress.timing_callback(f"timing {label}"),
            )
        return _Timed(timing, run.finished_by)

    best = Candidate(module=working, device=device)
    with progress.step("running the model as given"):
        reference = _Reference(_outputs(best, context), working, context)
    baseline = time_candidate(finish(best), "the model as given")
    best_timed = baseline
    records: list[PassRecord] = []
    # (candidate, timing, index of its record) of the baseline (-1, always first) and of
    # kept passes that nothing kept later beats: those the result may fall back to.
    checkpoints: list[tuple[Candidate, _Timed, int]] = [(best, best_timed, -1)]
    for each in passes:
        before = best_timed
        if each.name in best_timed.finished_by:  # the best was timed in it: compare without
            before = time_candidate(_Finished(best, ()), f"the best without {each.name}")
        record, candidate, timed = _try(
            each, best, before, context, reference, finish, time_candidate
        )
        records.append(record)
        progress.log(record)
        if record.status == "kept":
            best, best_timed = candidate, timed
            if each.finisher:  # the candidates before it were timed as this one runs
                checkpoints = checkpoints[:1]
            faster = [c for c in checkpoints[1:] if c[1].timing.p50_ms < timed.timing.p50_ms]
            checkpoints = [checkpoints[0], *faster, (candidate, timed, len(records) - 1)]
            context.kept.append(each.name)
        elif before is not best_timed:  # it will not wrap the best: that runs without it
            best_timed = before
            checkpoints = [checkpoints[0], (best, best_timed, checkpoints[-1][2])]
    best, best_timed = _fastest(checkpoints, records)
    best_timing, baseline_timing = best_timed.timing, baseline.timing
    _mark_superseded(records, best)

    with progress.step("verifying the result"):
        final_accuracy = _compare(reference, _outputs(best, context), best.dtype, config)
    spec = _spec(best, context)
    optimized = OptimizedModule.from_candidate(
        best, spec=spec, output=config.output, example_args=best.runner_args(test_args[0])
    )
    if config.output == "padded" and not best.padded_detections:
        context.notes.append("output='padded' applies to detectors; outputs are the model's own")
    report = Report(
        software_context=software_context(),
        hardware_context=hardware_context(device),
        user_config={"level": level, "device": str(device), **config.to_dict()},
        diagnosis=_diagnosis(model_info, context, spec, baseline_timing, best_timing),
        optimizations=records,
        baseline=baseline_timing,
        optimized=best_timing,
        accuracy=final_accuracy,
        model_info={**model_info, "input_shapes": [list(s) for s in spec.input_shapes]},
        compatibility_list=[_compatibility(device, spec)],
        model_sdk={"load": "bladesmith.load(path)", "save": spec.save_hint},
    )
    return optimized, spec, report


@dataclass(frozen=True)
class _Timed:
    timing: Timing
    finished_by: tuple[str, ...] = ()  # the finisher passes it was timed in


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
    best_timed: _Timed,
    context: Context,
    reference,
    finish: Callable[[Candidate], _Finished],
    time_candidate: Callable[[_Finished, str], _Timed],
) -> tuple[PassRecord, Candidate | None, _Timed | None]:
    """Apply, verify and time one pass against the best candidate so far, timed as
    ``best_timed`` (without the pass, when the pass is a finisher it was timed in).
    The candidate is verified as it is timed and will run, wrapped by its finishers (a
    CUDA graph's capture may pick other convolution algorithms than eager calls)."""
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
            accuracy = _compare(
                reference, _outputs(run.candidate, context), candidate.dtype, config
            )
            if not accuracy.passed and run.finished_by:
                # Only the wrapped form moves? The finisher is at fault, and its own
                # trial rejects it: judge the candidate without it.
                bare = _compare(reference, _outputs(candidate, context), candidate.dtype, config)
                if bare.passed:
                    run, accuracy = _Finished(candidate, ()), bare
    except PassSkipped as error:
        return record("skipped", str(error)), None, None
    except Exception as error:  # a failing pass is reported, never fatal
        return record("failed", _describe(error)), None, None
    waived = each.changes_precision and config.disable_fp16_accuracy_check
    pre_run = best_timed.timing.p50_ms
    if not accuracy.passed and not waived:
        reason = f"outputs moved past tolerance{run.where} ({built}; not timed)"
        return record("rejected", reason, pre_run=pre_run, accuracy=accuracy), None, None
    try:
        timed = time_candidate(run, name)
    except Exception as error:
        return record("failed", f"timing: {_describe(error)}", accuracy=accuracy), None, None
    timing = timed.timing
    speedup = pre_run / timing.p50_ms
    fields = dict(pre_run=pre_run, post_run=timing.p50_ms, accuracy=accuracy, timing=timing)
    check = "accuracy check disabled" if not accuracy.passed else "outputs within tolerance"
    if run.finished_by:
        check += f", both timed{run.where}"
    if speedup >= config.min_speedup:
        reason = f"{speedup:.2f}x, {check} ({built})"
    elif each.enabler:
        reason = f"kept at {speedup:.2f}x: the passes after it need what it does; {check} ({built})"
    else:
        shown = _below_bar(speedup)
        reason = f"{shown}, below the {config.min_speedup:g}x needed to keep it ({built})"
        return record("rejected", reason, **fields), None, None
    return record("kept", reason, **fields), candidate, timed


def _below_bar(speedup: float) -> str:
    """A speedup under the bar, truncated to two decimals: 1.0297 is 1.02x, never a
    rounded 1.03x beside "below the 1.03x needed"."""
    return f"{math.floor(speedup * 100) / 100:.2f}x"


def _skip_reason(each: Pass, candidate: Candidate, context: Context) -> str | None:
    config = context.config
    if each.name in config.exclude:
        return "excluded by Config(exclude=...)"
    if context.level not in each.levels and each.name not in config.include:
        levels = ", ".join(each.levels)
        return f"not part of level {context.level} (it is in {levels}; or Config(include=...))"
    if context.device.type not in each.devices:
        return f"runs on {', '.join(each.devices)}; the device is {context.device.type}"
    if each.rewrites_modules and isinstance(candidate.module, torch.jit.ScriptModule):
        return "TorchScript modules cannot be rewritten; give optimize the nn.Module"
    return each.skip_reason(candidate, context)


def _fastest(checkpoints: list, records: list[PassRecord]) -> tuple[Candidate, _Timed]:
    """The fastest checkpoint. Normally the last, as a pass is kept only when faster;
    but an enabler is kept even when slower, and if nothing after it paid off, an
    earlier checkpoint wins: the passes kept after it are dropped, and say so."""
    candidate, timed, index = min(checkpoints, key=lambda checkpoint: checkpoint[1].timing.p50_ms)
    last = checkpoints[-1][1].timing
    for record in records[index + 1 :]:
        if record.status == "kept":
            record.status = "rejected"
            record.reason += (
                f"; dropped at the end: the result is faster without it "
                f"({timed.timing.p50_ms:.2f} ms against {last.p50_ms:.2f} ms)"
            )
    return candidate, timed


def _mark_superseded(records: list[PassRecord], final: Candidate) -> None:
    """A kept pass whose work a later pass replaced (another backend) says so."""
    for record in records:
        if record.status == "kept" and record.name not in final.applied:
            record.reason += f"; superseded by {final.backend}"


def _outputs(candidate: Candidate, context: Context) -> list:
    module = OptimizedModule.from_candidate(candidate)
    return [module(*args) for args in context.test_args]


class _Reference:
    """The model's outputs on the test inputs and, for a detector, the same under
    rounding noise: the detections that rounding alone flips are not held against a
    pass. The noisy runs are made the first time a comparison fails without them."""

    def __init__(self, outputs: list, model: nn.Module, context: Context):
        self.outputs, self.model, self.context = outputs, model, context
        self.detects = contains_detections(outputs)
        self._noisy: list | None = None

    def noisy(self) -> list:
        if self._noisy is None:
            try:
                with self.context.step("running the model as given under rounding noise"):
                    self._noisy = reference_under_noise(self.model, self.context.test_args)
                self.context.notes.append(
                    f"detections: the model as given ran {len(self._noisy)} more times with "
                    "its weights moved by rounding noise; what that alone flips is not held "
                    "against a pass (each pass's accuracy counts what it excused)"
                )
            except Exception as error:  # a model that cannot be copied is judged without
                self.context.notes.append(f"no rounding-noise runs ({_describe(error)})")
                self._noisy = []
        return self._noisy


def _compare(reference: _Reference, outputs, dtype: torch.dtype, config: Config) -> Comparison:
    rtol, atol = default_tolerance(dtype)
    rtol = config.rtol if config.rtol is not None else rtol
    atol = config.atol if config.atol is not None else atol

    def compare(noisy) -> Comparison:
        return compare_outputs(
            reference.outputs,
            outputs,
            noisy=noisy,
            rtol=rtol,
            atol=atol,
            iou_threshold=config.iou_threshold,
            min_f1=config.min_f1,
            score_atol=max(rtol + atol, detection_score_tolerance(dtype)),
        )

    comparison = compare(())
    return compare(reference.noisy()) if reference.detects and not comparison.passed else comparison


def _working_copy(model, device: torch.device) -> tuple[nn.Module, dict]:
    """A private copy of ``model`` in eval mode on ``device``, and what it is."""
    if isinstance(model, (str, os.PathLike)):
        module, kind = load_model_file(model), None
    elif isinstance(model, torch.export.ExportedProgram):
        module, kind = copy.deepcopy(model.module()), "torch.export program"
    elif isinstance(model, nn.Module):
        module = copy.deepcopy(model)
        kind = "TorchScript" if isinstance(model, torch.jit.ScriptModule) else "nn.Module"
    else:
        raise TypeError(
            "model: expected an nn.Module, a TorchScript module, a torch.export program or "
            f"the path of a .pt/.pt2 file, got {type(model).__name__}"
        )
    if kind is None:
        kind = (
            "TorchScript" if isinstance(module, torch.jit.ScriptModule) else "torch.export program"
        )
    was_training = module.training
    with contextlib.suppress(NotImplementedError):  # exported modules refuse eval()
        module.eval()
    tensors = [*module.parameters(), *module.buffers()]
    if any(tensor.device != device for tensor in tensors):
        module.to(device)
    info = {
        "name": getattr(module, "original_name", None)
        if isinstance(module, torch.jit.ScriptModule)
        else type(module).__name__,
        "format": kind,
        "parameters": sum(p.numel() for p in module.parameters()),
        "was_training": was_training,
    }
    return module, info


def load_model_file(path) -> nn.Module:
    """The module in a TorchScript (.pt) or torch.export (.pt2) file, on the CPU."""
    from bladesmith.errors import BladesmithError
    from bladesmith.runtimes.torchscript import quiet_torchscript

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: no file {path!r}")
    with contextlib.suppress(ImportError, BladesmithError):  # models may use our ops
        from bladesmith import ops

        ops.load_library()
    if path.endswith(AOTI_SUFFIX):
        try:
            return torch.export.load(path).module()
        except Exception as error:
            raise BladesmithError(
                f"model: {path!r} is not a torch.export program ({_describe(error)}); "
                "an AOTInductor package is already compiled: load it with bladesmith.load"
            ) from error
    try:
        with quiet_torchscript():
            return torch.jit.load(path, map_location="cpu")
    except RuntimeError as error:
        raise BladesmithError(
            f"model: {path!r} is not a loadable TorchScript file ({_describe(error)})"
        ) from error


def _entries(test_data) -> list[tuple]:
    if test_data is None or isinstance(test_data, (torch.Tensor, str)) or not len(test_data):
        raise ValueError(
            "test_data: expected a non-empty list of sample inputs, one entry per call: a "
            "tuple of arguments, or the single argument (a detector's: its list of images)"
        )
    return [entry if isinstance(entry, tuple) else (entry,) for entry in test_data]


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _batch_size(args: tuple) -> int:
    """Items per call, for throughput: a list of images, or a batch of images."""
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], torch.Tensor):
        return len(first)
    if isinstance(first, torch.Tensor) and first.dim() == 4:
        return first.shape[0]
    return 1


def _spec(best: Candidate, context: Context) -> Spec:
    if best.padded_detections:
        output = OUTPUT_PADDED if context.config.output == "padded" else OUTPUT_DETECTIONS
    else:
        output = OUTPUT_AS_MODEL
    leaves = pytree.tree_leaves(best.runner_args(context.example_args))
    return Spec(
        device=str(context.device),
        dtype=str(best.dtype).removeprefix("torch."),
        input_shapes=tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)),
        output=output,
        passes=best.applied,
        backend=best.backend,
        save_formats=_save_formats(best, context.device),
    )


def _save_formats(best: Candidate, device: torch.device) -> tuple[str, ...]:
    """The formats ``save`` can write, the one closest to what runs first."""
    if isinstance(best.module, torch.jit.ScriptModule):
        formats = [TORCHSCRIPT_SUFFIX]
    elif device.type == "cuda":
        formats = [AOTI_SUFFIX, TORCHSCRIPT_SUFFIX]
    else:
        formats = [TORCHSCRIPT_SUFFIX, AOTI_SUFFIX]
    if device.type == "cpu":
        position = 0 if best.backend == "onnxruntime" else len(formats)
        formats.insert(position, ONNX_SUFFIX)
    return tuple(formats)


def _diagnosis(info: dict, context: Context, spec: Spec, baseline: Timing, best: Timing) -> dict:
    speedup = baseline.p50_ms / best.p50_ms
    kept = ", ".join(spec.passes) or "no pass"
    lines = [
        f"{info['name']} ({info['format']}, {info['parameters'] / 1e6:.1f}M parameters) on "
        f"{context.device}, level {context.level}.",
        *context.notes,
        f"Kept {kept}: {baseline.p50_ms:.2f} ms -> {best.p50_ms:.2f} ms ({speedup:.2f}x); "
        f"runs as {spec.backend} in {spec.dtype}.",
    ]
    return {"message": "\n".join(lines), "notes": list(context.notes), "speedup": speedup}


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


def _check_pass_names(config: Config, passes: Sequence[Pass]) -> None:
    known = {each.name for each in passes}
    unknown = (set(config.include) | set(config.exclude)) - known
    if unknown:
        raise ValueError(
            f"Config include/exclude: no pass named {sorted(unknown)}; passes are "
            f"{', '.join(each.name for each in passes)}"
        )


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


class _Progress:
    """A spinner on stderr naming the step in progress; nested steps show the inner one."""

    def __init__(self, enabled: bool):
        from rich.console import Console

        self.console = Console(stderr=True) if enabled else None
        self._status = None
        self._text = ""

    @contextlib.contextmanager
    def step(self, text: str):
        if self.console is None:
            yield
        elif self._status is not None:
            outer = self._text
            self._show(text)
            try:
                yield
            finally:
                self._show(outer)
        else:
            with self.console.status(text) as status:
                self._status, self._text = status, text
                try:
                    yield
                finally:
                    self._status = None

    def timing_callback(self, label: str):
        if self.console is None:
            return None

        def update(stage: str, done: int, total: int) -> None:
            # Every tenth of the runs: a redraw per run would steal time from the host.
            if done == total or done % max(1, total // 10) == 0:
                self._show(f"{label}: {stage} {done}/{total}")

        return update

    def log(self, record: PassRecord) -> None:
        if self.console is not None:
            from rich.markup import escape

            style = {"kept": "green", "rejected": "yellow", "failed": "red"}.get(
                record.status, "dim"
            )
            self.console.print(
                f"[{style}]{record.status:>8}[/] {escape(record.name)}: {escape(record.reason)}",
                highlight=False,
            )

    def _show(self, text: str) -> None:
        self._text = text
        if self._status is not None:
            self._status.update(text)
