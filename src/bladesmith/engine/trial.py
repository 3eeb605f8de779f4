"""One pass tried against the best candidate so far: applied, verified on the test data
and then on held-out inputs, timed against the best, and recorded with why it was kept
or not.

Candidates are verified and timed as they will run: wrapped by the finisher passes that
apply to them (a CUDA graph on the GPU; its capture may pick other convolution
algorithms than eager calls), which a finisher's own record then compares with the
candidate without it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bladesmith import bench
from bladesmith.artifact import OptimizedModule
from bladesmith.bench import Speedup
from bladesmith.config import Config
from bladesmith.engine.heldout import HeldOutCheck
from bladesmith.engine.reference import Reference
from bladesmith.errors import describe
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped
from bladesmith.progress import Progress
from bladesmith.report import PassRecord
from bladesmith.runtimes.torchscript import is_torchscript

# Times a comparison is re-run when its interval holds the bar but its figure clears
# it: three times the rounds narrow a 99% interval from the rounds' extremes to their
# 8th and 23rd of 30.
UNDECIDED_EXTENSIONS = 2


class Finished(NamedTuple):
    """A candidate as it will run: wrapped by the finisher passes named."""

    candidate: Candidate
    finished_by: tuple[str, ...]

    @property
    def where(self) -> str:
        """ " in cuda_graph" (its finishers, for reasons and labels), or "" without any."""
        return f" in {' + '.join(self.finished_by)}" if self.finished_by else ""


@dataclass
class Trial:
    """What every pass is tried with: the run's context, the reference outputs and
    held-out inputs it is verified on, the finishers it is wrapped by and how it is
    timed (``timing``: ``bench.compare``'s warmup, iters, rounds and device)."""

    context: Context
    reference: Reference
    held_out: HeldOutCheck
    finishers: list[Pass]
    timing: dict
    batch_size: int
    progress: Progress

    def finish(self, candidate: Candidate) -> Finished:
        """``candidate`` wrapped by each finisher that applies to it and is not in it
        yet. The model as given is left as is: it may not survive a capture (host
        synchronisations), which the finisher's own trial reports, if it comes to it."""
        if not candidate.applied:
            return Finished(candidate, ())
        finished_by = []
        for finisher in self.finishers:
            if finisher.name in candidate.applied or skip_reason(finisher, candidate, self.context):
                continue
            try:
                candidate = finisher.apply(candidate, self.context)
            except Exception:  # its own trial, later, reports why
                continue
            finished_by.append(finisher.name)
        return Finished(candidate, tuple(finished_by))

    def time_against(self, before: Finished, run: Finished, label: str) -> Speedup:
        """``run`` (a candidate as it will run) against ``before``, timed in alternating
        rounds; an interval that straddles the bar is timed again over more rounds."""
        label += run.where
        bar = self.context.config.min_speedup
        with self.progress.step(f"timing {label}"):
            return bench.compare(
                as_called(before.candidate),
                as_called(run.candidate),
                self.context.test_args[0],
                batch_size=self.batch_size,
                progress=self.progress.timing_callback(f"timing {label}"),
                undecided=lambda speedup: speedup.ratio >= bar and not speedup.clears(bar),
                max_extensions=UNDECIDED_EXTENSIONS,
                **self.timing,
            )

    def __call__(
        self, each: Pass, best: Candidate, before: Finished
    ) -> tuple[PassRecord, Candidate | None, Finished | None]:
        """Apply, verify and time ``each`` against ``best``, as it runs (``before``:
        without the pass, when the pass is a finisher it was timed in). Returns its
        record and, when kept, the candidate and what it was timed as."""
        name, config = each.name, self.context.config

        def record(status, reason, **fields):
            return PassRecord(name=name, status=status, reason=reason, **fields)

        skip = skip_reason(each, best, self.context)
        if skip:
            return record("skipped", skip), None, None
        started = time.perf_counter()
        try:
            with self.context.step(f"{name}: applying"):
                candidate = each.apply(best, self.context)
                run = self.finish(candidate)
            built = f"built in {time.perf_counter() - started:.1f} s"
            run, accuracy, outputs = self._verified(name, candidate, run)
        except PassSkipped as error:
            return record("skipped", str(error)), None, None
        except Exception as error:  # a failing pass is reported, never fatal
            return record("failed", describe(error)), None, None
        waived = each.changes_precision and config.disable_fp16_accuracy_check
        # Int8 outputs move by far more than rounding: the task's metric on held-out
        # inputs judges them, before timing (a wrong result is rejected for being wrong).
        by_metric = candidate.computes_in.by_metric
        held = None
        if by_metric:
            with self.context.step(f"{name}: the task's metric on held-out inputs"):
                held = self.held_out.check(run.candidate, outputs, config, who=name)
            if held is None or not held.passed:
                none = f"no held-out input to judge it on ({self.held_out.described(True)})"
                why = held.line if held else none
                return (
                    record("rejected", f"{why} ({built}; not timed)", accuracy=accuracy),
                    None,
                    None,
                )
        if accuracy.degenerate and not config.allow_degenerate:
            reason = (
                f"not kept on a comparison with nothing to compare "
                f"({'; '.join(accuracy.degenerate)}); Config(allow_degenerate=True) keeps "
                f"passes on it ({built}; not timed)"
            )
            return record("rejected", reason, accuracy=accuracy), None, None
        if not accuracy.passed and not waived and not by_metric:
            reason = f"outputs moved past tolerance{run.where} ({built}; not timed)"
            return record("rejected", reason, accuracy=accuracy), None, None
        unverified = accuracy.unverified if each.changes_arithmetic and not by_metric else ""
        if unverified and not (config.allow_unverified or waived):
            reason = (
                f"not kept: it changes the arithmetic, and {unverified}; "
                f"Config(allow_unverified=True) keeps it unverified ({built}; not timed)"
            )
            return record("rejected", reason, accuracy=accuracy), None, None
        try:
            speedup = self.time_against(before, run, name)
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
        if by_metric:
            check = "judged by the task's metric"
        elif not accuracy.passed:
            check = "accuracy check disabled"
        else:
            check = "outputs within tolerance"
        if run.finished_by:
            check += f", both timed{run.where}"
        if unverified:
            consent = (
                "allow_unverified" if config.allow_unverified else "disable_fp16_accuracy_check"
            )
            check += f", not verified on these inputs (kept as Config({consent}=True) asks)"
        kept, reason = _speed_verdict(each, speedup, config.min_speedup, check, built)
        if not kept:
            if held is not None:  # judged by the metric first: what it measured stays said
                reason += f"; {held.line}"
            return record("rejected", reason, **fields), None, None
        if not by_metric:
            with self.context.step(f"{name}: verifying on held-out inputs"):
                held = self.held_out.check(run.candidate, outputs, config, who=name, waived=waived)
        if held is None and speedup.implausible and not config.allow_degenerate:
            why = f"{speedup.describe()} is implausible, and no held-out input could check it"
            return record("rejected", f"{why} ({self.held_out.how})", **fields), None, None
        if held is None and speedup.implausible:  # outputs that say nothing, as consented
            reason += f"; {speedup.describe()} is implausible and unchecked on held-out inputs"
            reason += f" ({self.held_out.how}), kept as Config(allow_degenerate=True) asks"
        if held is not None and not held.passed:
            reason = f"{held.line} ({built}; timed at {speedup.describe()})"
            return record("rejected", reason, **fields), None, None
        if held is not None:
            reason += f"; {held.line}"
            if speedup.implausible:
                reason += " (the figure is implausible: kept only as the held-out check passed)"
        return record("kept", reason, **fields), candidate, run

    def _verified(self, name: str, candidate: Candidate, run: Finished):
        """``name``'s ``candidate`` verified as it will run (``run``): (what it runs as, its
        comparison with the reference, its outputs)."""
        context, config = self.context, self.context.config
        with context.step(f"{name}: verifying"):
            outputs = outputs_on(run.candidate, context.test_args)
            accuracy = self.reference.compare(outputs, candidate.dtype, config)
            if not accuracy.passed and run.finished_by:
                # Only the wrapped form moves? The finisher is at fault, and its own
                # trial rejects it: judge the candidate without it.
                bare_outputs = outputs_on(candidate, context.test_args)
                bare = self.reference.compare(bare_outputs, candidate.dtype, config)
                if bare.passed:
                    return Finished(candidate, ()), bare, bare_outputs
        return run, accuracy, outputs


def _speed_verdict(
    each: Pass, speedup: Speedup, bar: float, check: str, built: str
) -> tuple[bool, str]:
    """Whether ``speedup`` keeps ``each`` (an enabler is kept even when not faster), and
    the reason its record gives."""
    if speedup.clears(bar):
        return True, f"{speedup.describe()}, {check} ({built})"
    if each.enabler:
        return True, (
            f"kept at {speedup.describe()}: the passes after it need what it does; "
            f"{check} ({built})"
        )
    if speedup.ratio >= bar:
        return False, (
            f"{speedup.describe()}: the interval holds the {bar:g}x needed to keep it, so "
            f"the gain is within the noise ({built})"
        )
    return False, f"{below_bar(speedup.ratio)}, below the {bar:g}x needed to keep it ({built})"


def below_bar(speedup: float) -> str:
    """A speedup under the bar, truncated to two decimals: 1.0297 is 1.02x, never a
    rounded 1.03x beside "below the 1.03x needed"."""
    return f"{math.floor(speedup * 100) / 100:.2f}x"


def skip_reason(each: Pass, candidate: Candidate, context: Context) -> str | None:
    """Why ``each`` is not tried on ``candidate`` (the config, the level, the device, a
    TorchScript module, or the pass's own reason), or None."""
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


def tolerance_waived(candidate: Candidate, passes: Sequence[Pass], config: Config) -> bool:
    """Whether ``candidate``'s tolerance is waived: a precision pass in it, and
    Config(disable_fp16_accuracy_check=True)."""
    return config.disable_fp16_accuracy_check and any(
        each.changes_precision and each.name in candidate.applied for each in passes
    )


def outputs_on(candidate: Candidate, calls: list[tuple]) -> list:
    """``candidate``'s outputs on each of ``calls``, as ``optimize`` would return it."""
    module = OptimizedModule.from_candidate(candidate)
    return [module(*args) for args in calls]


def as_called(candidate: Candidate) -> Callable:
    """What ``optimize`` returns for ``candidate``, as it is timed: the model as given is
    its own call path (no wrapper: nothing can be slower than the model itself)."""
    if not candidate.applied:
        module = candidate.module

        def own(*args, **kwargs):
            with torch.no_grad():
                return module(*args, **kwargs)

        return own
    return OptimizedModule.from_candidate(candidate)
