"""Build and load the custom-operator library in ``csrc/`` (torch.ops.bladesmith).

The library is compiled through ``torch.utils.cpp_extension`` on first use (or ahead of
time with ``bladesmith ops build``) into ``$BLADESMITH_CACHE/ops/<key>`` (default
``~/.cache/bladesmith/ops/<key>``), where the key hashes the sources, the torch version and
the build flags, so that an edit or another torch gets its own build. Once built, loading
needs no compiler: only ``torch.ops.load_library(path)``.

CUDA kernels (``csrc/cuda/*.cu``) are compiled in when a GPU and nvcc are present, or when
``BLADESMITH_OPS_CUDA=1`` forces it (to compile-check without a GPU);
``BLADESMITH_OPS_CUDA=0`` forces a CPU-only build.

Only the standard library is imported at module level: ``import bladesmith.ops`` stays
cheap and torch is imported on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

from bladesmith.errors import OpsBuildError, quiet_log
from bladesmith.toolchain import compiler_name, cuda_home, nvcc_path

NAME = "bladesmith_ops"
CSRC = Path(__file__).parent / "csrc"
# A stamp written after a build loaded successfully: a library file without it may be
# half-written by a build that is still running or was killed.
_STAMP = "built.ok"
_DEFAULT_GPU_ARCH = (9, 0)

_lock = threading.Lock()
_loaded: str | None = None  # the library loaded in this process


@dataclasses.dataclass(frozen=True)
class LibraryStatus:
    """What ``status()`` found: whether the library is built, where, and if it loads."""

    built: bool
    path: str | None
    loadable: bool | None  # None: not tried (not built, or another one is loaded)
    detail: str


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything that determines one build: its inputs and where it goes."""

    cuda: bool
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / f"{NAME}{_cpp_extension().LIB_EXT}"


def cache_root() -> Path:
    """``$BLADESMITH_CACHE``, or ``~/.cache/bladesmith``."""
    root = os.environ.get("BLADESMITH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "bladesmith"


def want_cuda(cuda: bool | None = None) -> bool:
    """Whether the build includes the CUDA kernels: ``cuda`` if given, else the
    ``BLADESMITH_OPS_CUDA`` environment variable, else whether a GPU and nvcc are here."""
    if cuda is not None:
        return cuda
    forced = os.environ.get("BLADESMITH_OPS_CUDA", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise OpsBuildError(f"BLADESMITH_OPS_CUDA: expected 0 or 1, got {forced!r}")
    import torch

    return torch.cuda.is_available() and _nvcc() is not None


def library_path(cuda: bool | None = None) -> str:
    """The shared library loaded in this process, or else the path where the build for this
    configuration is (or will be); it may not exist yet. Never builds or loads."""
    if _loaded is not None:
        return _loaded
    return str(_plan(want_cuda(cuda)).library)


def load_library(cuda: bool | None = None, verbose: bool = False) -> str:
    """Build the operator library if needed, load it once per process, register the fake
    kernels, and return the path of the shared library.

    Raises ``OpsBuildError`` naming the missing compiler or header when it cannot be built,
    or when a library of another configuration is already loaded in this process.
    """
    global _loaded
    if _loaded is not None:
        _check_same_configuration(cuda)
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _registered_library()
        if _loaded is None:
            plan = _plan(want_cuda(cuda))
            if not (plan.directory / _STAMP).is_file():
                _build(plan, verbose)
            _loaded = _load(plan.library)
    _check_same_configuration(cuda)
    return _loaded


def unavailable() -> str | None:
    """Why the operator library cannot be loaded here, or None once it is (building it
    first if needed): what a pass that calls the operators reports when it skips."""
    try:
        load_library()
    except OpsBuildError as error:
        return f"the operator library cannot be built: {error}"
    return None


def status(cuda: bool | None = None) -> LibraryStatus:
    """Whether the library of this configuration is built and loads, without building it.
    When built and not yet loaded, it is loaded (that is the test)."""
    try:
        plan = _plan(want_cuda(cuda))
    except OpsBuildError as error:
        return LibraryStatus(built=False, path=None, loadable=None, detail=str(error))
    path = str(plan.library)
    if _loaded == path:
        return LibraryStatus(True, path, True, f"loaded from {path}")
    if not (plan.directory / _STAMP).is_file():
        missing = _missing_tools(plan.cuda)
        detail = (
            f"not built; cannot build here: {'; '.join(missing)}"
            if missing
            else "not built; the first use builds it (a minute or two)"
        )
        return LibraryStatus(False, path, None, detail)
    if _loaded is not None:
        detail = f"built, but {_loaded} is already loaded in this process"
        return LibraryStatus(True, path, None, detail)
    try:
        load_library(cuda)
    except OpsBuildError as error:
        return LibraryStatus(True, path, False, str(error))
    return LibraryStatus(True, path, True, f"loaded from {path}")


def _check_same_configuration(cuda: bool | None) -> None:
    if cuda is not None and str(_plan(cuda).library) != _loaded:
        raise OpsBuildError(
            f"the operator library {_loaded} is already loaded in this process; "
            f"build the {'CUDA' if cuda else 'CPU-only'} one in a fresh process"
        )


def _plan(cuda: bool) -> _Plan:
    import torch

    directories = [CSRC, CSRC / "cpu"] + ([CSRC / "cuda"] if cuda else [])
    patterns = ("*.cpp", "*.cu") if cuda else ("*.cpp",)
    sources = tuple(sorted(p for d in directories for pat in patterns for p in d.glob(pat)))
    headers = tuple(sorted(p for d in directories for pat in ("*.h", "*.cuh") for p in d.glob(pat)))
    if sys.platform == "win32":
        cflags: tuple[str, ...] = ("/O2",)
        ldflags: tuple[str, ...] = ()
    else:
        # No fused multiply-add: torchvision's arithmetic rounds after every operation.
        cflags = ("-O3", "-ffp-contract=off")
        ldflags = ()
    if sys.platform.startswith("linux"):
        # at::parallel_for is inline: without OpenMP here it runs serially. The OpenMP
        # runtime is not linked, so its symbols resolve to torch's own (torch.set_num_threads
        # applies, one thread pool).
        cflags += ("-fopenmp",)
        # Drops libtorch_python from the link, so C++ programs can load the library too.
        ldflags = ("-Wl,--as-needed",)
    cuda_cflags = ("-O3", *_cuda_arch_flags()) if cuda else ()

    digest = hashlib.sha256()
    for part in (
        torch.__version__,
        str(torch.version.cuda),
        sys.platform,
        cflags,
        cuda_cflags,
        ldflags,
    ):
        digest.update(repr(part).encode())
    for path in sources + headers:
        digest.update(path.relative_to(CSRC).as_posix().encode())
        digest.update(path.read_bytes())
    key = f"{'cuda' if cuda else 'cpu'}-{digest.hexdigest()[:16]}"
    return _Plan(cuda, sources, cflags, cuda_cflags, ldflags, cache_root() / "ops" / key)


def _cuda_arch_flags() -> list[str]:
    """The local GPUs' architectures, else sm_90; none when TORCH_CUDA_ARCH_LIST is set,
    which cpp_extension then honours."""
    import torch

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return []
    if torch.cuda.is_available():
        capabilities = sorted(
            {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        )
    else:
        capabilities = [_DEFAULT_GPU_ARCH]
    return [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in capabilities]


def _cpp_extension():
    import logging

    # It warns at import when it finds a CUDA toolkit without a GPU: no news for a CPU build.
    with quiet_log("torch.utils.cpp_extension", logging.ERROR):
        import torch.utils.cpp_extension as cpp_extension
    return cpp_extension


def _nvcc() -> Path | None:
    return nvcc_path(cuda_home())


def _missing_tools(cuda: bool) -> list[str]:
    """What a build needs and does not find here, each named with how to get it."""
    import torch

    missing = []
    compiler = compiler_name()
    if shutil.which(compiler) is None:
        missing.append(
            f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang++, or set CXX)"
        )
    if shutil.which("ninja") is None:
        missing.append("no ninja build tool on PATH (pip install ninja)")
    header = Path(_cpp_extension().include_paths()[0]) / "torch" / "library.h"
    if not header.is_file():
        missing.append(f"no torch C++ header {header} (this torch install lacks its headers)")
    if cuda:
        if torch.version.cuda is None:
            missing.append(f"torch {torch.__version__} was built without CUDA")
        home = cuda_home()
        if _nvcc() is None:
            missing.append(f"no nvcc (CUDA_HOME={home}; set CUDA_HOME to the CUDA toolkit)")
        elif not Path(home, "include", "cuda_runtime.h").is_file():
            missing.append(
                f"no CUDA header {Path(home, 'include', 'cuda_runtime.h')} "
                "(set CUDA_HOME to the CUDA toolkit)"
            )
    return missing


def _build(plan: _Plan, verbose: bool) -> None:
    missing = _missing_tools(plan.cuda)
    if missing:
        raise OpsBuildError("cannot build the operator library: " + "; ".join(missing))
    plan.directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(plan.directory):
        if (plan.directory / _STAMP).is_file():  # another process built it meanwhile
            return
        kind = "CPU and CUDA" if plan.cuda else "CPU"
        print(
            f"bladesmith: building the custom-operator library ({kind} kernels) in "
            f"{plan.directory}; the first build takes a minute or two",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        try:
            _cpp_extension().load(
                name=NAME,
                sources=[str(p) for p in plan.sources],
                extra_cflags=list(plan.cflags),
                extra_cuda_cflags=list(plan.cuda_cflags),
                extra_ldflags=list(plan.ldflags),
                extra_include_paths=[str(CSRC)],
                build_directory=str(plan.directory),
                with_cuda=plan.cuda,
                is_python_module=False,
                verbose=verbose,
            )
        except (RuntimeError, OSError) as error:
            raise OpsBuildError(_explain(error, plan)) from error
        (plan.directory / _STAMP).write_text(f"{plan.library}\n")
    print(
        f"bladesmith: built {plan.library} in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def _exclusive(directory: Path):
    """One builder per directory across processes, with an OS lock that dies with its
    holder. Under it, a leftover cpp_extension 'lock' file (older torch versions use the
    file's mere existence) can only come from a killed build, so it is removed."""
    try:
        import fcntl
    except ImportError:  # Windows: cpp_extension's own lock is all there is
        yield
        return
    with open(directory / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _explain(error: Exception, plan: _Plan) -> str:
    """The compiler's own error lines (a missing header names itself), not the whole log."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if re.search(r"\berror\b", line, re.I)]
    summary = "\n  ".join(dict.fromkeys(lines[:8])) or text.strip()[-2000:]
    return (
        f"building the operator library in {plan.directory} failed:\n  {summary}\n"
        f"(run `bladesmith ops build --verbose` for the full log)"
    )


def _registered_library() -> str | None:
    """A library that defines torch.ops.bladesmith loaded by other means (an artifact's own
    copy, through torch.ops.load_library): loading a second one would clash, so use it."""
    import torch

    if not hasattr(torch.ops.bladesmith, "batched_nms"):
        return None
    import bladesmith.ops.fake  # noqa: F401  (registers the fake kernels)

    paths = [p for p in torch.ops.loaded_libraries if Path(p).name.startswith(NAME)]
    return paths[0] if paths else "(loaded by another library)"


def _load(path: Path) -> str:
    import torch

    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        raise OpsBuildError(f"cannot load the operator library {path}: {error}") from error
    import bladesmith.ops.fake  # noqa: F401  (registers the fake kernels)

    return str(path)
