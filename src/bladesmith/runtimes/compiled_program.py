"""Compiled program: ``.ptc``, the model as torch.export programs (one per input
signature, each fixed to its shapes) with the code Inductor compiled for them, so that a
new process runs Inductor's kernels without compiling them again; the inductor pass's
result saves in it.

A ``.ptc`` is a ZIP archive, stored uncompressed, of ``program_N.pt2`` (what
``torch.export.save`` writes, read back without pickle by ``pt2_archive``),
``inductor.bin`` (``torch.compiler.save_cache_artifacts()`` after compiling those
programs: Inductor's and AOTAutograd's cache entries, generated code, on a GPU Triton's
compiled kernels), on a CPU ``kernels/`` (the shared libraries Inductor built from its
C++ kernels, which torch's cache entries hold only as source: without them the first
call at load compiles the C++ again, a minute for a ResNet-50) and bladesmith's
metadata (``bladesmith.json``: the settings it was compiled
with, torch's and Triton's versions, the device, the shapes, each member's SHA-256).
Loading puts the compiled code in Inductor's caches (``load_cache_artifacts``) and
compiles each program with the same settings: the first call finds everything in the
cache and takes seconds instead of minutes. That runs code the file brings (Inductor's
cache entries are pickles of generated code and libraries), so a ``.ptc`` loads only
under ``--trust``, as a ``.pt2`` does.

On a GPU the call is captured at its first call in a CUDA graph over static input
buffers, when the result kept the cuda_graph pass (what was timed in process).

A file built on another torch, Triton or device still runs, compiled again from its
programs (minutes; said in one line on stderr): its programs are plain torch.export, and
torch's cache keys would miss there anyway. A member whose bytes differ from the
recorded SHA-256 is refused; a file without ``inductor.bin`` compiles again, saying so.

Freezing (``inductor_configs={"freezing": True}``) folds the weights into the kernels as
constants; torch's caches skip frozen graphs (``fxgraph_cache_bypass``), so a frozen
``.ptc`` carries no compiled code and compiles at every load. By default a result is
saved as its inductor pass timed it: frozen on a CPU (unfrozen, ResNet-50's file ran at
0.57x of the result there), unfrozen on a GPU (where freezing changed nothing
measurable). ``max_autotune`` is recorded and given to the compile at load, whose
autotuning results the cache carries.

What Inductor compiled is kept in ``$BLADESMITH_CACHE/compiled`` by the hash of the
programs, the settings and the software and device it was compiled with: a second save of
the same result copies it instead of compiling again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import sys
import time
import unittest.mock
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from bladesmith.errors import BladesmithError
from bladesmith.onnx.exporter import baked_arguments
from bladesmith.progress import Progress
from bladesmith.runtimes import aoti, pt2_archive
from bladesmith.runtimes.built_for import BuiltFor, describe_tensors, signature, tensors_in
from bladesmith.runtimes.format import Format
from bladesmith.trust import WRITTEN_HERE, require

SUFFIX = ".ptc"
_PROGRAM = "program_{}.pt2"
_COMPILED = "inductor.bin"
_KERNELS = "kernels/"
# A C++ kernel's library in Inductor's cache folder: "<2 characters>/<key>.main.so".
_KERNEL = re.compile(r"[a-z0-9]{2}/[a-z0-9]+\.main\.so")
# The Inductor settings a .ptc records and compiles with, and their defaults.
SETTINGS = {"max_autotune": False, "freezing": False}
# Set by the inductor pass on what it compiled: the settings it compiled with.
SETTINGS_ATTRIBUTE = "bladesmith_inductor_settings"


def settings(inductor_configs: dict | None, runner=None) -> dict:
    """The settings to compile with: ``inductor_configs``' (save's), else those the
    inductor pass compiled ``runner`` with, else ``SETTINGS``; one line for any other key."""
    given = dict(inductor_configs or {})
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise BladesmithError(
            f"save: a {SUFFIX} records only the Inductor settings {', '.join(SETTINGS)}; "
            f"got {', '.join(unknown)} (AOTInductor's options go to a .pt2)"
        )
    return {**SETTINGS, **_pass_settings(runner), **{k: bool(v) for k, v in given.items()}}


def _pass_settings(runner) -> dict:
    """The settings the inductor pass recorded on ``runner`` or what it wraps (a CUDA
    graph's candidate, the candidate's runner); {} when none did."""
    for _ in range(4):
        if runner is None:
            return {}
        found = getattr(runner, SETTINGS_ATTRIBUTE, None)
        if found is not None:
            return {key: bool(found[key]) for key in SETTINGS if key in found}
        runner = getattr(runner, "fn", None) or getattr(runner, "runner", None)
    return {}


def compile_mode(chosen: dict) -> str:
    """torch.compile's mode for ``chosen``: Inductor's own CUDA graphs stay off (the
    loader captures the whole call itself)."""
    return "max-autotune-no-cudagraphs" if chosen["max_autotune"] else "default"


def compiled(program: torch.export.ExportedProgram, chosen: dict) -> Callable:
    """The program's module compiled with ``chosen`` (its first call compiles)."""
    mode = compile_mode(chosen)
    module = torch.compile(program.module(), mode=mode, dynamic=False)

    def call(*args, **kwargs):
        # Inductor reads its config when it compiles, on the first call.
        with torch._inductor.config.patch(freezing=chosen["freezing"]), torch.no_grad():
            return module(*args, **kwargs)

    return call


def environment(device: torch.device) -> dict:
    """What compiled code is valid for: torch, Triton and the device it runs on."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    else:
        where = f"cpu ({_cpu_name()})"
    return {"torch": torch.__version__, "triton": triton_version, "device": where}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_folder() -> Path:
    from bladesmith.ops.build import cache_root

    return cache_root() / "compiled"


def write(
    module, calls: list[tuple], path: Path, metadata: dict, *, key: str, name: str, **options
):
    """``module`` exported once per input signature of ``calls`` and compiled by Inductor
    with the settings (``settings``), its compiled code taken from the cache when the same
    programs were compiled before; the archive at ``path``, with the metadata under
    ``key``."""
    progress = Progress(options.pop("progress", None))
    chosen = settings(options.get("inductor_configs"), options.get("runner"))
    device = torch.device(metadata["device"])
    programs = []
    for args in calls:
        buffer = io.BytesIO()
        torch.export.save(torch.export.export(module, args, strict=False), buffer)
        programs.append(buffer.getvalue())
    where = environment(device)
    cache_key = _cache_key(programs, chosen, where)
    blob, kernels, build_seconds, from_cache = _compiled_code(
        programs, calls, chosen, cache_key, progress, name
    )
    members = {_PROGRAM.format(i): data for i, data in enumerate(programs)}
    if blob is not None:
        members[_COMPILED] = blob
        members.update({_KERNELS + kernel: data for kernel, data in kernels.items()})
    metadata["inputs"] = {"free_batch": False, "why": "torch.export fixed its shapes"}
    metadata["models"] = [
        {
            "name": _PROGRAM.format(i),
            "shapes": [shape for shape, _ in signature(args)],
            "dtypes": [dtype for _, dtype in signature(args)],
            "constants": baked_arguments(module, args),
        }
        for i, args in enumerate(calls)
    ]
    metadata["compiled"] = {
        "settings": chosen,
        "mode": compile_mode(chosen),
        **where,
        "compiled_code": blob is not None,
        "build_seconds": round(build_seconds, 1),
        "from_cache": from_cache,
        "cache_key": cache_key,
        "cuda_graph": device.type == "cuda"
        and "cuda_graph" in metadata.get("spec", {}).get("passes", ()),
        "sha256": {member: hashlib.sha256(data).hexdigest() for member, data in members.items()},
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for member, data in members.items():
            archive.writestr(member, data)
        archive.writestr(f"{key}.json", json.dumps(metadata))


def _cache_key(programs: list[bytes], chosen: dict, where: dict) -> str:
    digest = hashlib.sha256(json.dumps([chosen, where], sort_keys=True).encode())
    for data in programs:
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def _compiled_code(programs, calls, chosen, cache_key, progress, name):
    """(Inductor's compiled code for ``programs``, or None where torch's caches keep
    none; the C++ kernels' libraries, by their place in Inductor's cache folder; the
    seconds compiling took; whether it came from bladesmith's cache)."""
    folder = cache_folder() / cache_key
    record = folder / "record.json"
    if record.exists():
        saved = json.loads(record.read_text())
        code = folder / _COMPILED
        kernels = {
            each: (folder / each.replace("/", "_")).read_bytes() for each in saved["kernels"]
        }
        return (code.read_bytes() if code.exists() else None), kernels, saved["seconds"], True
    from torch.compiler._cache import CacheArtifactManager

    start = time.perf_counter()
    with CacheArtifactManager.with_fresh_cache(), _cpp_kernels_built() as built:
        for number, (data, args) in enumerate(zip(programs, calls), 1):
            step = f"saving {name}: Inductor compiling for {describe_tensors(signature(args))}"
            if len(calls) > 1:
                step += f" ({number} of {len(calls)})"
            with progress.step(step):
                # What the loader compiles: the program as read back from its bytes.
                compiled(pt2_archive.exported_program(io.BytesIO(data)), chosen)(*args)
        saved = torch.compiler.save_cache_artifacts()
    seconds = time.perf_counter() - start
    blob = saved[0] if saved is not None else None
    kernels = _libraries(built) if blob is not None else {}
    folder.mkdir(parents=True, exist_ok=True)
    if blob is not None:
        _write_atomically(folder / _COMPILED, blob)
    for each, data in kernels.items():
        _write_atomically(folder / each.replace("/", "_"), data)
    summary = {"seconds": seconds, "kernels": sorted(kernels)}
    _write_atomically(record, json.dumps(summary).encode())
    return blob, kernels, seconds, False


@contextlib.contextmanager
def _cpp_kernels_built():
    """The C++ kernels Inductor writes (or finds written) while inside, as the paths of
    their sources in its cache folder: what its compiled graphs load at their first call."""
    from torch._inductor import codecache

    sources: list[str] = []
    write_source = codecache.write

    def recording(content, extension, *args, **kwargs):
        written = write_source(content, extension, *args, **kwargs)
        if extension == "main.cpp":
            sources.append(written[1])
        return written

    with unittest.mock.patch.object(codecache, "write", recording):
        yield sources


def _libraries(sources: list[str]) -> dict[str, bytes]:
    """The libraries built from C++ kernel ``sources``, by their place in Inductor's cache
    folder ("ab/cabc….main.so")."""
    found = {}
    for source in sources:
        library = Path(source).with_suffix(".so")
        place = f"{library.parent.name}/{library.name}"
        if library.exists() and _KERNEL.fullmatch(place):
            found[place] = library.read_bytes()
    return found


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}.partial-{time.monotonic_ns()}")
    partial.write_bytes(data)
    partial.replace(path)


def metadata(path: Path, key: str) -> str | None:
    with zipfile.ZipFile(path) as archive:
        member = f"{key}.json"
        return archive.read(member).decode() if member in archive.namelist() else None


def read(path: Path, info: dict, trust: bool = False) -> dict[BuiltFor, Callable]:
    """Each program compiled with the recorded settings, from the compiled code the file
    holds (its first call takes seconds), captured in a CUDA graph on its first call where
    the result kept one; only when ``trust``."""
    require(
        path, "the Inductor-compiled code it holds (generated kernels, shared libraries)", trust
    )
    saved = info["compiled"]
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        members = {m: archive.read(m) for m in saved["sha256"] if m in names}
    # The metadata (a top-level JSON) aside, every member is recorded.
    unrecorded = sorted(
        name for name in names - set(saved["sha256"]) if "/" in name or not name.endswith(".json")
    )
    if unrecorded:
        raise BladesmithError(f"{unrecorded[0]} is not recorded in its metadata")
    for member, digest in saved["sha256"].items():
        if member in members and hashlib.sha256(members[member]).hexdigest() != digest:
            raise BladesmithError(
                f"{member} differs from the SHA-256 its metadata records (the file was "
                "changed after bladesmith.save wrote it): save it again"
            )
    device = torch.device(info["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BladesmithError(
            f"it was compiled for {saved['device']} and this machine has no CUDA device"
        )
    kernels = {m[len(_KERNELS) :]: data for m, data in members.items() if m.startswith(_KERNELS)}
    _load_compiled_code(path, saved, members.get(_COMPILED), kernels, device, trust)
    why = info["inputs"]["why"]
    runs = {}
    for model in info["models"]:
        if model["name"] not in members:
            raise BladesmithError(f"{model['name']} is missing from the archive")
        program = pt2_archive.exported_program(io.BytesIO(members[model["name"]]))
        run = compiled(program, saved["settings"])
        if saved.get("cuda_graph") and device.type == "cuda":
            run = FixedShapeGraph(run, device, model["shapes"])
        runs[aoti._compiled_for(model, why)] = run
    return runs


def _load_compiled_code(
    path: Path, saved: dict, blob: bytes | None, kernels: dict, device, trust
) -> None:
    """Inductor's caches filled from ``blob`` and ``kernels`` (the C++ kernels' libraries,
    put in its cache folder where they are not); where they cannot serve, one line on
    stderr saying that the programs compile again, and why (unless ``trust`` is
    ``WRITTEN_HERE``)."""
    here = environment(device)
    built = {k: saved[k] for k in ("torch", "triton", "device")}
    why = None
    if not saved["compiled_code"]:
        why = "it holds no compiled code (frozen: torch's caches skip frozen graphs)"
    elif built != here:
        changed = [f"{k} {built[k]} there, {here[k]} here" for k in built if built[k] != here[k]]
        why = f"it was compiled elsewhere ({'; '.join(changed)})"
    elif blob is None:
        why = f"its {_COMPILED} is missing"
    elif torch.compiler.load_cache_artifacts(blob) is None:
        why = f"its {_COMPILED} did not load"
    else:
        _place_kernels(kernels)
    if why and trust != WRITTEN_HERE:
        print(
            f"bladesmith: {str(path)!r}: {why}: Inductor compiles its programs again on the "
            "first call (seconds to minutes)",
            file=sys.stderr,
        )


def _place_kernels(kernels: dict[str, bytes]) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    for place, data in kernels.items():
        if not _KERNEL.fullmatch(place):
            raise BladesmithError(f"{_KERNELS}{place} is not the name of a compiled kernel")
        target = root / place
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(target, data)


class FixedShapeGraph:
    """``run`` replayed from a CUDA graph over static input buffers for the shapes it was
    compiled for (captured on the first call of them); a call of other shapes runs
    ``run`` itself."""

    def __init__(self, run: Callable, device: torch.device, shapes):
        from bladesmith.runtimes.cuda_graph import CudaGraphRunner

        self.run = run
        self.shapes = [tuple(shape) for shape in shapes]
        self.graph = CudaGraphRunner(run, device)

    def __call__(self, *args, **kwargs):
        tensors = tensors_in((args, kwargs))
        if [tuple(x.shape) for x in tensors] != self.shapes:
            return self.run(*args, **kwargs)
        if not self.graph.graphs:  # compiled first, as the cuda_graph pass found it
            self.run(*args, **kwargs)
        return self.graph(*args, **kwargs)


class CompiledProgram(Format):
    suffix = SUFFIX
    description = "torch.export programs with Inductor's compiled code (loads warm in seconds)"
    devices = ("cuda", "cpu")
    # Built during optimize: only the inductor pass's result is saved in it, whose compile
    # that pass has paid for already; later saves copy it from the cache.
    build_cost = "seconds"
    build_note = (
        "Inductor compiling its programs; kept in $BLADESMITH_CACHE/compiled by their hash, "
        "so saving the same result again copies it"
    )
    zip_archive = True
    needs_fake_kernels = True  # torch.export traces the operators on fake tensors
    triton_backend = None
    only_its_pass = True

    refuses = aoti.AOTInductor.refuses
    refuses_operators = aoti.AOTInductor.refuses_operators
    write = staticmethod(write)
    metadata = staticmethod(metadata)
    read = staticmethod(read)


FORMAT = CompiledProgram()
