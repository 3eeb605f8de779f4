"""The speedup of what ``save`` writes: the result saved in its first format, reloaded
in a new process and timed there alone, against the model as given timed alone in this
one (before and after, so that the phases bracket a change of load).

The in-process figure times the result as optimize holds it, in alternation with the
model as given; a deployment runs the file. What the two share (the kernels, the
arithmetic) they agree on; what they do not (a runner that only lives in the optimizing
process, threads of another runtime spinning beside the baseline) shows as a gap
between the two figures, which the report gives side by side.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from bladesmith import bench
from bladesmith.artifact import OptimizedModule, write
from bladesmith.bench import Speedup
from bladesmith.errors import describe
from bladesmith.fresh_load import in_new_process

_CHILD = """
import sys, torch, bladesmith
from bladesmith import bench
module = bladesmith.load(sys.argv[1])
job = torch.load(sys.argv[2], weights_only=False)
with torch.no_grad():
    rounds = bench.time_rounds(module, job["args"], job["warmup"], job["iters"], job["rounds"])
torch.save(rounds, sys.argv[3])
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
            "method": "saved, reloaded in a new process and timed there alone; the model as "
            "given timed alone here before and after",
            **self.speedup.to_dict(),
        }

    @property
    def doubts(self) -> tuple[str, ...]:
        return self.speedup.doubts if self.speedup is not None else ()

    def describe(self) -> str:
        if self.speedup is None:
            return f"saved: not measured ({self.why})"
        return f"saved as {self.suffix} and reloaded in a new process: {self.speedup.describe()}"


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
    given's call) timed alone here in half the rounds before and half after."""
    if not suffixes:
        return SavedSpeed(None, None, "no format it saves in was tried")
    suffix = suffixes[0]
    # Two calls more than the warm-up: the in-process result ran on the test data while
    # it was verified, and TorchScript's profiling executor specialises on its first two.
    job = dict(args=args, warmup=warmup + 2, iters=iters, rounds=rounds)
    first = max(rounds // 2, 1)
    try:
        with tempfile.TemporaryDirectory(prefix="bladesmith-saved-") as folder:
            path = Path(folder) / f"model{suffix}"
            write(optimized, path)
            before = bench.time_rounds(given, args, warmup, iters * first // rounds or 1, first)
            saved, problem = in_new_process(_CHILD, path, job)
            rest = rounds - first
            left = iters - iters * first // rounds
            after = bench.time_rounds(given, args, 0, left, rest) if rest else []
    except Exception as error:
        return SavedSpeed(suffix, None, describe(error))
    if problem is not None:
        return SavedSpeed(suffix, None, problem)
    speedup = bench.from_phases(
        before + after, saved, warmup=warmup, batch_size=batch_size, device=device
    )
    return SavedSpeed(suffix, speedup)
