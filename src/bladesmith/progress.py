"""Where a long call is (``optimize``, ``save`` compiling a .pt2): a spinner on a
terminal, plain lines elsewhere. A leaf: the engine and the artifact both show steps."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bladesmith.bench import Speedup
    from bladesmith.report import PassRecord


class Progress:
    """Where ``optimize`` is (and ``save``, compiling a .pt2's models): a spinner naming
    the step on a terminal (nested steps show the inner one); elsewhere (a pipe, a log
    file, a notebook's captured stderr) plain lines, one per pass with its verdict and one
    for the result; nothing when off."""

    PREFIX = "bladesmith: "

    def __init__(self, enabled: bool | None):
        self.console = None
        self.lines = False
        self._status = None
        self._text = ""
        if enabled is False:
            return
        if sys.stderr.isatty():
            from rich.console import Console

            self.console = Console(stderr=True)
        else:
            self.lines = True

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
        if self.lines:
            self._line(f"{record.status} {record.name}: {record.reason}")
        elif self.console is not None:
            from rich.markup import escape

            style = {"kept": "green", "rejected": "yellow", "failed": "red"}.get(
                record.status, "dim"
            )
            self.console.print(
                f"[{style}]{record.status:>8}[/] {escape(record.name)}: {escape(record.reason)}",
                highlight=False,
            )

    def done(self, overall: Speedup, saved=None) -> None:
        """The result's line: the saved artifact's figure (``saved``, a ``SavedSpeed``)
        first, then the in-process one."""
        if self.lines:
            self._line(
                "result: "
                + (f"{saved.describe()}; " if saved is not None else "")
                + f"in this process {overall.baseline.p50_ms:.2f} ms -> "
                f"{overall.candidate.p50_ms:.2f} ms (p50), {overall.describe()}"
                + (" (in doubt: see the report's diagnosis)" if overall.doubts else "")
            )

    def _line(self, text: str) -> None:
        print(self.PREFIX + text, file=sys.stderr, flush=True)

    def _show(self, text: str) -> None:
        self._text = text
        if self._status is not None:
            self._status.update(text)
