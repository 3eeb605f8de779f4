"""The speedup of what ``save`` writes: the result saved in its first format, reloaded
in a new process (two, sharing the rounds, where each gets ``ROUNDS_PER_PROCESS``), and
timed there in rounds that take turns with rounds of the model as given in this one (one
side at a time on the machine), each round's pair next to each other in time, as
``bench.compare`` pairs them in one process.

The in-process figure times the result as optimize holds it, in alternation with the
model as given; a deployment runs the file. What the two share (the kernels, the
arithmetic) they agree on; what they do not (a runner that only lives in the optimizing
process, threads of another runtime spinning beside the baseline) shows as a gap
between the two figures, which the report gives side by side. Pairing the rounds in
time matters on a shared machine: the model as given timed in one phase and the file
in the next read a change of load (10-15% on a 2-core machine) as part of the speedup.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from bladesmith import bench
from bladesmith.artifact import OptimizedModule, write
from bladesmith.bench import Speedup
from bladesmith.errors import describe
from bladesmith.fresh_load import NewProcessFailed, conversation

# A process of its own can run a file 10-40% slower or faster than the next one does (a
# 2-core machine, measured): the rounds are shared between two processes where each
# gets enough of them to be a figure, so that the interval holds both.
ROUNDS_PER_PROCESS = 5

# Each request is a count of calls: the reply is their (wall ms, CPU ms) samples.
_CHILD = """
import sys, torch, bladesmith
from bladesmith.trust import QUIET
from bladesmith import bench
module = bladesmith.load(sys.argv[1], trust=QUIET)
args = torch.load(sys.argv[2], weights_only=False)
with torch.no_grad():
    for calls in requests():
        reply(bench.time_round(module, args, calls))
"""


@dataclass(frozen=True)
class SavedSpeed:
    """The saved artifact's speedup (None when not measured) and in what format, or why
    it was not measured."""

    suffix: str | None
    speedup: Speedup | None
    why: str = ""

    def to_dict(self) -> dict:
        if self.speedup is None:
            return {"format": self.suffix, "measured": False, "why": self.why}
        return {
            "format": self.suffix,
            "measured": True,
            "method": "saved, reloaded in a new process (two, sharing the rounds, where "
            f"each gets {ROUNDS_PER_PROCESS}) and timed there in rounds that take turns "
            "with the model as given's here, each side alone on the machine",
            **self.speedup.to_dict(),
        }

    @property
    def doubts(self) -> tuple[str, ...]:
        return self.speedup.doubts if self.speedup is not None else ()

    def describe(self) -> str:
        if self.speedup is None:
            return f"saved: not measured ({self.why})"
        return f"saved as {self.suffix} and reloaded in a new process: {self.speedup.describe()}"


def _shares(sizes: list[int]) -> list[list[int]]:
    """The rounds each new process times: two processes when each gets at least
    ``ROUNDS_PER_PROCESS`` rounds, else one."""
    if len(sizes) < 2 * ROUNDS_PER_PROCESS:
        return [sizes]
    half = len(sizes) // 2
    return [sizes[:half], sizes[half:]]


def _in_turn(given, path: Path, args: tuple, sizes: list[int], warmup: int):
    """(the model as given's rounds, the file's): a round of each per size, taking turns
    (A/B, then B/A, as bench.compare alternates), the file's in new processes."""
    given_rounds, saved_rounds = [], []
    bench.time_round(given, args, max(warmup, 1))
    for share in _shares(sizes):
        with conversation(_CHILD, path, args) as saved:
            # Two calls more than the warm-up: the in-process result ran on the test
            # data while it was verified; TorchScript's profiling executor specialises
            # on its first two.
            saved(warmup + 2)
            for size in share:
                for which in (0, 1) if len(given_rounds) % 2 == 0 else (1, 0):
                    if which == 0:
                        given_rounds.append(bench.time_round(given, args, size))
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
) -> SavedSpeed:
    """``optimized`` written in the first of ``suffixes`` (the formats save was checked
    in), reloaded in a new process and timed there, against ``given`` (the model as
    given's call) timed here: ``iters`` calls each, in ``rounds`` rounds that take turns."""
    if not suffixes:
        return SavedSpeed(None, None, "no format it saves in was tried")
    suffix = suffixes[0]
    try:
        with tempfile.TemporaryDirectory(prefix="bladesmith-saved-") as folder:
            path = Path(folder) / f"model{suffix}"
            write(optimized, path)
            rounds_of = _in_turn(given, path, args, bench.round_sizes(iters, rounds), warmup)
    except NewProcessFailed as failure:
        return SavedSpeed(suffix, None, str(failure))
    except Exception as error:
        return SavedSpeed(suffix, None, describe(error))
    speedup = bench.from_rounds(*rounds_of, warmup=warmup, batch_size=batch_size, device=device)
    return SavedSpeed(suffix, speedup)
