"""The speedup of what ``save`` writes: the result saved in its first format, reloaded
in a new process (two, sharing the rounds, where each gets ``ROUNDS_PER_PROCESS``), and
timed there in rounds that take turns with rounds of the model as given, itself rebuilt
in a new process of its own beside each (one side at a time on the machine), each
round's pair next to each other in time, as ``bench.compare`` pairs them in one process.

Both sides fresh: the model as given timed warm in the optimizing process (its caches,
its allocator, the threads of what ran before) and the file in a new one measured the
two processes as much as the two models (a detector read 1.00x there and 1.09x in two
new processes). The model as given goes to its process as it can: a TorchScript module
saved as itself, any other module pickled (``torch.save``) to a private file that only
that process reads, which needs every class of it importable there. A model that cannot
go (a class defined in ``__main__`` or inside a function, or one that does not pickle)
is timed in this process, and the report says why.

A figure whose rounds disagree too much (``MAX_INTERVAL_WIDTH``) is no result: the
machine was too loaded to measure it, and the report says that instead.

The in-process figure times the result as optimize holds it, in alternation with the
model as given; a deployment runs the file. What the two share (the kernels, the
arithmetic) they agree on; what they do not (a runner that only lives in the optimizing
process, threads of another runtime spinning beside the baseline) shows as a gap
between the two figures, which the report gives side by side. Pairing the rounds in
time matters on a shared machine: the model as given timed in one phase and the file
in the next read a change of load (10-15% on a 2-core machine) as part of the speedup.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bladesmith import bench
from bladesmith.artifact import OptimizedModule, write
from bladesmith.bench import Speedup
from bladesmith.errors import describe
from bladesmith.fresh_load import NewProcessFailed, conversation
from bladesmith.runtimes.torchscript import is_torchscript

# A process of its own can run a file 10-40% slower or faster than the next one does (a
# 2-core machine, measured): the rounds are shared between two processes where each
# gets enough of them to be a figure, so that the interval holds both.
ROUNDS_PER_PROCESS = 5
# The widest interval (high over low) that is still a figure, one that says the speedup
# within a factor of two: a machine under other work gave DeepLabV3 5.96x [2.98-17.29]
# (5.8 times) where two quiet processes give 2.06x.
MAX_INTERVAL_WIDTH = 2.0

# Each request is a count of calls: the reply is their (wall ms, CPU ms) samples.
_TIMED = """
args = torch.load(sys.argv[2], weights_only=False)
with torch.no_grad():
    for calls in requests():
        reply(bench.time_round(module, args, calls))
"""
_CHILD = (
    """
import sys, torch, bladesmith
from bladesmith.trust import QUIET
from bladesmith import bench
module = bladesmith.load(sys.argv[1], trust=QUIET)
"""
    + _TIMED
)
# The model as given: a file this process wrote for it alone, from the user's own model
# (the classes it imports are the user's, found on this process's path, which
# ``_given_side`` puts first).
_GIVEN_CHILD = (
    """
import sys, torch
from bladesmith import bench
path = sys.argv[1]
module = torch.jit.load(path) if path.endswith(".pt") else torch.load(path, weights_only=False)
"""
    + _TIMED
)


@dataclass(frozen=True)
class SavedSpeed:
    """The saved artifact's speedup and in what format, or why it was not measured (then
    ``speedup`` is None, or the rounds that were too far apart to be a figure);
    ``given``: where the model as given was timed, and why there."""

    suffix: str | None
    speedup: Speedup | None
    why: str = ""
    given: str = "in a new process of its own"

    @property
    def measured(self) -> bool:
        return self.speedup is not None and not self.why

    def to_dict(self) -> dict:
        if not self.measured:
            given = {"given": self.given} if self.speedup is not None else {}
            return {"format": self.suffix, "measured": False, "why": self.why, **given}
        return {
            "format": self.suffix,
            "measured": True,
            "method": "saved, reloaded in a new process (two, sharing the rounds, where "
            f"each gets {ROUNDS_PER_PROCESS}) and timed there in rounds that take turns "
            f"with the model as given's, timed {self.given}, each side alone on the machine",
            "given": self.given,
            **self.speedup.to_dict(),
        }

    @property
    def doubts(self) -> tuple[str, ...]:
        return self.speedup.doubts if self.measured else ()

    def describe(self) -> str:
        if not self.measured:
            return f"saved: not measured ({self.why})"
        return (
            f"saved as {self.suffix} and reloaded in a new process: {self.speedup.describe()} "
            f"(the model as given timed {self.given})"
        )


def _shares(sizes: list[int]) -> list[list[int]]:
    """The rounds each new process times: two processes when each gets at least
    ``ROUNDS_PER_PROCESS`` rounds, else one."""
    if len(sizes) < 2 * ROUNDS_PER_PROCESS:
        return [sizes]
    half = len(sizes) // 2
    return [sizes[:half], sizes[half:]]


class _GivenProcessFailed(NewProcessFailed):
    """The model as given's own process failed (not the file's)."""


def given_file(module, folder: Path) -> tuple[Path | None, str]:
    """(``module``, the model as given, written in ``folder`` for a new process to rebuild,
    "") or (None, why it cannot be)."""
    if is_torchscript(module):
        path = folder / "given.pt"
        torch.jit.save(module, str(path))
        return path, ""
    local = sorted(
        {
            f"{type(part).__qualname__} (in {type(part).__module__})"
            for part in module.modules()
            if type(part).__module__ == "__main__" or "<locals>" in type(part).__qualname__
        }
    )
    if local:
        return None, (
            f"its class {', '.join(local)} is defined in a script or inside a function, "
            "which a new process cannot import"
        )
    path = folder / "given.pkl"
    try:
        torch.save(module, path)
    except Exception as error:
        return None, f"it does not pickle for a new process ({describe(error)})"
    return path, ""


@contextlib.contextmanager
def _given_side(given: Callable, path: Path | None, args: tuple) -> Iterator[Callable]:
    """A round of the model as given (a count of calls -> its samples): in a new process
    of its own when it was written for one (``path``), else here (``given``)."""
    if path is None:
        yield lambda calls: bench.time_round(given, args, calls)
        return
    code = f"import sys\nsys.path[:0] = {sys.path!r}\n" + _GIVEN_CHILD
    with conversation(code, path, args) as ask:

        def timed(calls: int):
            try:
                return tuple(ask(calls))
            except NewProcessFailed as failure:  # told apart from the file's process
                raise _GivenProcessFailed(str(failure)) from None

        yield timed


def _in_turn(given, given_path, path: Path, args: tuple, sizes: list[int], warmup: int):
    """(the model as given's rounds, the file's): a round of each per size, taking turns
    (A/B, then B/A, as bench.compare alternates), the file's in new processes, the model
    as given's in a new process beside each (``given_path``) or here."""
    given_rounds, saved_rounds = [], []
    for share in _shares(sizes):
        with (
            _given_side(given, given_path, args) as timed_given,
            conversation(_CHILD, path, args) as saved,
        ):
            # Two calls more than the warm-up on each side: the in-process result ran on
            # the test data while it was verified; TorchScript's profiling executor
            # specialises on its first two.
            timed_given(warmup + 2)
            saved(warmup + 2)
            for size in share:
                for which in (0, 1) if len(given_rounds) % 2 == 0 else (1, 0):
                    if which == 0:
                        given_rounds.append(timed_given(size))
                    else:
                        saved_rounds.append(tuple(saved(size)))
    return given_rounds, saved_rounds


def saved_speed(
    optimized: OptimizedModule,
    suffixes,
    given,
    args: tuple,
    *,
    warmup: int,
    iters: int,
    rounds: int,
    batch_size: int,
    device,
    given_module=None,
) -> SavedSpeed:
    """``optimized`` written in the first of ``suffixes`` (the formats save was checked
    in), reloaded in a new process and timed there, against the model as given
    (``given_module``) rebuilt in a new process of its own, or, where it cannot be or is
    not given, ``given`` (its call) timed here: ``iters`` calls each, in ``rounds``
    rounds that take turns."""
    if not suffixes:
        return SavedSpeed(None, None, "no format it saves in was tried")
    suffix = suffixes[0]
    sizes = bench.round_sizes(iters, rounds)
    here = "in this process: no model to rebuild elsewhere"
    try:
        with tempfile.TemporaryDirectory(prefix="bladesmith-saved-") as folder:
            path = Path(folder) / f"model{suffix}"
            write(optimized, path)
            given_path = None
            if given_module is not None:
                given_path, why = given_file(given_module, Path(folder))
                here = f"in this process, as it cannot be rebuilt in a new one: {why}"
            try:
                rounds_of = _in_turn(given, given_path, path, args, sizes, warmup)
                where = "in a new process of its own" if given_path else here
            except _GivenProcessFailed as failure:
                where = f"in this process, as its own process failed: {failure}"
                rounds_of = _in_turn(given, None, path, args, sizes, warmup)
    except NewProcessFailed as failure:
        return SavedSpeed(suffix, None, str(failure))
    except Exception as error:
        return SavedSpeed(suffix, None, describe(error))
    speedup = bench.from_rounds(*rounds_of, warmup=warmup, batch_size=batch_size, device=device)
    if speedup.high > MAX_INTERVAL_WIDTH * speedup.low:
        return SavedSpeed(
            suffix,
            speedup,
            f"the machine was too loaded to measure it: the rounds gave {speedup.describe()}, "
            f"an interval wider than {MAX_INTERVAL_WIDTH:g} times, which is no figure; "
            "time it on a quiet machine",
            where,
        )
    return SavedSpeed(suffix, speedup, given=where)
