"""The spinner that says which step of ``optimize`` is running."""

from __future__ import annotations

import contextlib

from bladesmith.report import PassRecord


class Progress:
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
