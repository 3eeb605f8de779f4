"""Files written whole or not at all: to a temporary name beside the target, then renamed.

Every file bladesmith writes (artifacts, reports, charts, ONNX exports and fixes, bench
tables) goes through here, so all of them get the mode a new file gets (0666 less the
umask: 0644 usually), never ``mkstemp``'s private 0600, and a crash never leaves half a
file under the target's name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """``write(temporary)`` to a temporary file beside ``path`` (same suffix: some writers
    check it), then move it to ``path``; return ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        move_into_place(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def move_into_place(temporary: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename a finished file to ``path`` (same file system), with a new file's mode."""
    os.chmod(temporary, _new_file_mode())
    os.replace(temporary, path)


def _new_file_mode() -> int:
    umask = os.umask(0)  # the only way to read it; set back at once
    os.umask(umask)
    return 0o666 & ~umask
