"""The work folders and shared-memory regions of ``bladesmith serve``, each named after
the process that owns it (its pid and start time), so that the next start removes
those whose process is gone: a server killed with SIGKILL cannot remove its own."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

_OWNED = re.compile(r"^bladesmith[-_](?:serve|triton)[-_](\d+)\.(\d+)[-_]")
_SHARED_MEMORY = Path("/dev/shm")


def owner_tag(pid: int | None = None) -> str:
    """``PID.START`` of this process (or ``pid``): what names its folders and regions."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start_time(pid)}"


def work_folder(kind: str) -> tempfile.TemporaryDirectory:
    """A new folder ``bladesmith-KIND-PID.START-*`` (mode 0700) in the temporary folder,
    once the folders and regions of servers that are gone are removed."""
    remove_stale()
    return tempfile.TemporaryDirectory(prefix=f"bladesmith-{kind}-{owner_tag()}-")


def remove_stale() -> list[Path]:
    """Remove this user's serve folders and regions whose owner process is gone; the
    paths removed."""
    removed = []
    places = [Path(tempfile.gettempdir())] + [_SHARED_MEMORY] * _SHARED_MEMORY.is_dir()
    for place in places:
        with contextlib.suppress(OSError):
            for path in place.iterdir():
                found = _OWNED.match(path.name)
                if not found or _alive(int(found[1]), found[2]):
                    continue
                with contextlib.suppress(OSError):
                    if path.lstat().st_uid != os.getuid():
                        continue
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                    removed.append(path)
    return removed


def _alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot), or "" where none runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]
