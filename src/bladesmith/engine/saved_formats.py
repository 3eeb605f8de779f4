"""The result saved in each format, loaded back and judged: which formats ``optimize``
lists in the spec as saved and verified."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bladesmith.artifact import OptimizedModule, load, write
from bladesmith.errors import describe
from bladesmith.trust import WRITTEN_HERE


def try_formats(
    optimized: OptimizedModule,
    formats,
    test_args: list[tuple],
    judge: Callable,
    built: dict[str, float] | None = None,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Save ``optimized`` in each of ``formats``, load it back and run it on every test
    input: (the formats whose outputs ``judge`` passes, in order; {suffix: why} for the
    others). ``judge(outputs)`` returns a ``verify.Comparison``; ``built``, when given,
    gets the seconds each written format took to write."""
    tried, refused = [], {}
    with tempfile.TemporaryDirectory(prefix="bladesmith-save-") as directory:
        for suffix in formats:
            path = Path(directory) / f"model{suffix}"
            try:
                start = time.perf_counter()
                write(optimized, path)
                if built is not None:
                    built[suffix] = time.perf_counter() - start
                loaded = load(path, trust=WRITTEN_HERE)
                outputs = [loaded(*args) for args in test_args]
            except Exception as error:  # torch's messages may start on a new line
                refused[suffix] = f"saving it and loading it back failed ({describe(error)})"
                continue
            comparison = judge(outputs)
            if comparison.passed:
                tried.append(suffix)
            else:
                refused[suffix] = (
                    f"saved and loaded back, its outputs moved past tolerance "
                    f"({comparison.summary()})"
                )
    return tuple(tried), refused
