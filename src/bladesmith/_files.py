"""Files written whole or not at all: to a temporary name beside the target, then renamed.

Every file bladesmith writes (artifacts, reports, charts, ONNX exports and fixes, bench
tables) goes through here, so all of them get the mode a new file gets (0666 less the
umask: 0644 usually), never ``mkstemp``'s private 0600, and a crash never leaves half a
file under the target's name. ``unreadable``, ``unwritable`` and ``contents`` say, in a
few words for an error message, why a path cannot be read or written and what a file
holds when it is not what was expected.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
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


# Names of what ``replacing`` writes, beside the targets: ".NAME.saving-PID-XXXXXXXX".
_SAVING = ".saving-"
_SAVER = re.compile(re.escape(_SAVING) + r"(\d+)-")


@contextlib.contextmanager
def replacing(path: str | os.PathLike, folder: str | os.PathLike) -> Iterator[tuple[Path, Path]]:
    """A file and the folder beside it (an artifact and its libraries) replaced together.

    Yields a temporary file name and an empty temporary folder beside the targets, for
    the block to write. When it ends cleanly, the folder (none, if left empty) and then
    the file take their places, each by a rename, the previous folder removed last; when
    it raises (or SIGTERM ends it, in the main thread), both are removed and the
    previous file and folder are as they were. What a save killed outright left beside
    them (its process gone) is removed first. Between the renames, microseconds, the old
    file and the new folder are together."""
    path, folder = Path(path), Path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path, folder)
    tag = f"{_SAVING}{os.getpid()}-{secrets.token_hex(4)}"
    file = path.with_name(f".{path.name}{tag}{path.suffix}")  # some writers check it
    staged = folder.with_name(f".{folder.name}{tag}")
    staged.mkdir()
    try:
        with _sigterm_as_exit():
            yield file, staged
            _swap(file, path, staged, folder, folder.with_name(f".{folder.name}{tag}-old"))
    finally:
        file.unlink(missing_ok=True)
        _remove(staged)


def _swap(file: Path, path: Path, staged: Path, folder: Path, aside: Path) -> None:
    had_folder = folder.exists() or folder.is_symlink()
    if had_folder:
        os.replace(folder, aside)
    try:
        if any(staged.iterdir()):
            os.replace(staged, folder)
        move_into_place(file, path)
    except BaseException:
        if had_folder:
            _remove(folder)
            os.replace(aside, folder)
        raise
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _remove_leftovers(path: Path, folder: Path) -> None:
    """What ``replacing`` wrote for ``path`` and ``folder`` in a process that has ended."""
    if sys.platform == "win32" or not path.parent.is_dir():
        return  # no signal 0 there to ask whether a process is running
    for name in (path.name, folder.name):
        for leftover in path.parent.glob(f".{name}{_SAVING}*"):
            match = _SAVER.search(leftover.name[len(name) + 1 :])
            if match is not None and not _running(int(match.group(1))):
                _remove(leftover)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit inside the block, so that the block's clean-up runs;
    only where SIGTERM would end the process anyway (the main thread, torch's and the
    user's own handler untouched)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def end(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _new_file_mode() -> int:
    umask = os.umask(0)  # the only way to read it; set back at once
    os.umask(umask)
    return 0o666 & ~umask


def unreadable(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as a file, in a few words naming the fix, or None."""
    path = Path(path)
    if not path.exists():
        return "no such file"
    if path.is_dir():
        return "a folder, not a file"
    if not os.access(path, os.R_OK):
        return "permission denied (make it readable: chmod u+r)"
    if path.stat().st_size == 0:
        return "an empty file"
    return None


def unwritable(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at ``path``, naming the fix, or None."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        return "is a folder: name a file in it"
    if not folder.is_dir():
        return f"the folder {str(folder)!r} does not exist (create it first)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{str(folder)!r} is not a writable folder (permission denied)"
    try:  # as write_atomically will (a pseudo file system such as /proc passes os.access)
        tempfile.NamedTemporaryFile(dir=folder).close()
    except OSError as error:
        return f"cannot create a file in {str(folder)!r} ({error.strerror or error})"
    return None


def contents(path: str | os.PathLike) -> str:
    """What ``path`` holds, as far as its first bytes and a ZIP's names tell: for error
    messages that say what a file is when it is not what was expected."""
    path = Path(path)
    with open(path, "rb") as stream:
        head = stream.read(8)
    if head.startswith(b"PK"):
        try:
            archive = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError):
            return "a damaged ZIP archive (truncated or corrupt)"
        with archive:
            return _archive_contents(archive)
    if head.startswith(b"\x80"):
        return "a pickle (torch.save's legacy format), not a model"
    if head[:1] == b"\x08":
        return "possibly an ONNX model"
    return "neither a ZIP archive nor a model file (unrecognised bytes)"


def _archive_contents(archive: zipfile.ZipFile) -> str:
    """What a ZIP archive holds, as its names and its pickle's first class tell."""
    names = archive.namelist()
    if any(name.endswith("/archive_format") for name in names):
        return "a torch.export or AOTInductor package"
    if any("/code/" in name for name in names):
        return "a TorchScript model"
    pickled = [name for name in names if name.endswith("/data.pkl")]
    if pickled:
        with archive.open(pickled[0]) as stream:
            top = _pickled_class(stream)
        if top is not None:
            return (
                f"a pickled {top} (torch.save(model)), which loads only with its Python "
                "code; not a model file"
            )
        return "a torch.save file (tensors or a state dict), not a model"
    return "a ZIP archive without a model in it"


# What a torch.save file of tensors and dicts of them refers to in its pickle.
_DATA_MODULES = ("torch", "torch._utils", "collections", "builtins", "__builtin__", "numpy")


def _pickled_class(stream) -> str | None:
    """The class of the object a torch.save pickle holds (``torchvision.models.resnet.
    ResNet``), when it is not tensors or containers of them: its first global, read from
    the opcodes without unpickling anything."""
    import pickletools

    try:
        for opcode, argument, _ in pickletools.genops(stream):
            if opcode.name == "GLOBAL":
                module, _, name = str(argument).partition(" ")
                return None if module in _DATA_MODULES else f"{module}.{name}"
            if opcode.name == "STACK_GLOBAL":  # protocol 4+: the names were pushed before
                return None
    except Exception:  # a damaged pickle: say what the caller says of it
        return None
    return None


def first_line(error: BaseException) -> str:
    """The sentence of an error's message that says what went wrong: the first line's
    first sentence (torch's carry advice and C++ stacks after it), or the last line for
    TorchScript's interpreter, whose message starts with the Python stack."""
    from bladesmith.errors import without_values

    text = without_values(str(error)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    line = lines[-1] if lines[0].startswith("The following operation failed") else lines[0]
    return line.split(". ", 1)[0].removesuffix(".")
