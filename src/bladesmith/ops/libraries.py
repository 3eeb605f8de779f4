"""The user's operator libraries: shared libraries that register operators with
``TORCH_LIBRARY(namespace, m)``, loaded with ``torch.ops.load_library`` (or
``--load-library`` on the command line).

bladesmith finds the operators a model calls outside torch's and its own namespaces,
attributes each namespace to a loaded library (the library whose binary holds the
namespace and the operator names: the registration strings ``TORCH_LIBRARY`` compiles
in), copies those libraries beside a saved artifact and loads them again with it: only
those its metadata records, by SHA-256, from the folder beside it.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import torch

from bladesmith.errors import BladesmithError
from bladesmith.ops.namespaces import is_builtin, operators_in
from bladesmith.trust import require

LIBRARY_FLAG = "--load-library"
# Where a saved artifact's libraries go: a folder beside it, "<artifact>.libs".
_FOLDER_SUFFIX = ".libs"
_INDEX = "libraries.json"
_UNKNOWN_OP = re.compile(r"Unknown builtin op: (?P<op>\w+::\w+)")


@dataclass(frozen=True)
class Library:
    """A loaded library and the operators of the model that come from it."""

    path: Path
    operators: tuple[str, ...]  # qualified names, "myops::scale_clip"

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(sorted({op.split("::")[0] for op in self.operators}))


def load(path: str | os.PathLike, source: str = LIBRARY_FLAG) -> Path:
    """Load one operator library (``torch.ops.load_library``), named in errors as
    ``source`` gives it; a missing or unloadable file is one line naming it. The same
    library loaded already (this file or a copy of it) is not loaded again, and one that
    defines a namespace this process defines already (a loaded library, stripped or not)
    is refused: either would register the namespace twice, which aborts the process (C++
    terminate)."""
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        found = sorted(library.name for library in path.glob("*.so"))
        inside = f"a library file in it ({', '.join(found)})" if found else "the library file"
        raise BladesmithError(f"{source} {path}: a folder; give {inside}")
    if not path.is_file():
        raise BladesmithError(f"{source} {path}: no such file")
    loaded = _loaded_copy(path)
    if loaded is not None:
        return loaded
    _check_namespaces(path, source)
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        raise BladesmithError(f"{source} {path}: cannot load it ({error})") from error
    return path


def _loaded_copy(path: Path) -> Path | None:
    """The loaded library that is ``path`` or holds the same bytes, if any."""
    for loaded in map(Path, sorted(torch.ops.loaded_libraries)):
        if loaded.resolve() == path or (
            loaded.is_file() and filecmp.cmp(loaded, path, shallow=False)
        ):
            return loaded
    return None


def _check_namespaces(path: Path, source: str) -> None:
    """One line when ``path`` defines a namespace that this process defines already.
    A stripped binary's bytes still name the namespaces it registers, but not how
    (TORCH_LIBRARY_IMPL and _FRAGMENT may share a defined one): one that names a defined
    namespace is loaded in a child process first, where that namespace is defined too."""
    defined = defined_namespaces(path)
    if defined is not None:
        taken = [namespace for namespace in sorted(defined) if _defined_here(namespace)]
    else:
        named = sorted(filter(_defined_here, _named_in(path, _user_namespaces())))
        taken = _redefined_by_loading(path, named, source) if named else []
    if taken:
        raise BladesmithError(
            f"{source} {path}: it defines the operator namespace {taken[0]} "
            f"(TORCH_LIBRARY), which {_definer(taken[0])}; a process takes one library per "
            "namespace (two builds or versions of one library?): load only one of them"
        )


def _defined_here(namespace: str) -> bool:
    """Whether a TORCH_LIBRARY (or ``torch.library.Library(namespace, "DEF")``) of this
    process defines ``namespace``: the dispatcher refuses a second definition in a raised
    error here, not in a static initializer, whose error aborts."""
    try:
        definition = torch._C._dispatch_library("DEF", namespace, "", __file__, 0)
    except RuntimeError:
        return True
    definition.reset()
    return False


def _user_namespaces() -> set[str]:
    """The namespaces of the operators registered in this process, torch's and
    bladesmith's own left out."""
    names = torch._C._dispatch_get_all_op_names()
    return {space for space in {name.partition("::")[0] for name in names} if not is_builtin(space)}


# A child process that loads a library (argv[1]) where the namespaces after it are
# defined first, as TORCH_LIBRARY defines them: a second definition aborts it.
_TRIAL = """
import sys, torch
held = []  # a definition lasts as long as its handle
for namespace in sys.argv[2:]:
    try:
        held.append(torch._C._dispatch_library("DEF", namespace, "", "", 0))
    except RuntimeError:  # torch defines it itself
        pass
torch.ops.load_library(sys.argv[1])
"""
_REDEFINED = re.compile(r"register the namespace (\w+)")
_TRIAL_TIMEOUT_S = 120


def _redefined_by_loading(path: Path, namespaces: list[str], source: str) -> list[str]:
    """Those of ``namespaces`` (defined here) that loading ``path`` defines again, tried
    in a child process. A child that hangs or dies otherwise says nothing of them, but
    loading the library here could do the same: refused in one line."""
    try:
        trial = subprocess.run(
            [sys.executable, "-c", _TRIAL, str(path), *namespaces],
            capture_output=True,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
            timeout=_TRIAL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise BladesmithError(
            f"{source} {path}: loading it in a separate process took over "
            f"{_TRIAL_TIMEOUT_S} s (its static initialisers hang?): check the library"
        ) from None
    if trial.returncode >= 0:  # loaded, or an error that load_library raises here too
        return []
    match = _REDEFINED.search(trial.stderr)
    if match and match.group(1) in namespaces:
        return [match.group(1)]
    last = (trial.stderr.strip().splitlines() or ["no message"])[-1]
    raise BladesmithError(
        f"{source} {path}: loading it in a separate process killed that process (signal "
        f"{-trial.returncode}: {last}); loaded here it could end this one: check the library"
    )


def _definer(namespace: str) -> str:
    """What defines ``namespace`` in this process, as the refusal says it."""
    sources = _schema_sources(namespace)
    for loaded in sorted(torch.ops.loaded_libraries):
        defined = defined_namespaces(loaded)
        if defined is None:  # stripped: the source file of the schemas, else the names
            defined = {namespace} if _named_in(Path(loaded), sources or {namespace}) else ()
        if namespace in defined:
            return f"{loaded} defines too and is loaded already"
    return "this process defines already (a library loaded otherwise, or torch.library)"


_DEFINED_AT = re.compile(r"^debug: registered at (\S+):\d+$", re.MULTILINE)


def _schema_sources(namespace: str) -> set[str]:
    """The source files that registered the schemas of ``namespace``, as the dispatcher
    records them: TORCH_LIBRARY compiles its ``__FILE__`` into the library, where strip
    leaves it, and a library of kernels alone for the namespace holds another."""
    return {
        match.group(1)
        for name in operators_in(namespace)
        for match in [_DEFINED_AT.search(torch._C._dispatch_dump(name))]
        if match is not None
    }


def _named_in(path: Path, strings: Iterable[str]) -> set[str]:
    """Those of ``strings`` (namespaces, source files) that ``path``'s bytes hold as C
    strings (one may end another: the linker keeps "ops" as the tail of "my_ops"); none
    from a file that cannot be read (``torch.ops.load_library`` says why)."""
    try:
        data = path.read_bytes()
    except OSError:
        return set()
    return {string for string in strings if string.encode() + b"\0" in data}


# TORCH_LIBRARY(ns, m) defines a static object TORCH_LIBRARY_static_init_<ns>; its
# mangled name (_ZL31TORCH_LIBRARY_static_init_myops, _ZN3fooL31...E in a C++
# namespace: one of the binary's ``_strings``) gives the name's length first.
# TORCH_LIBRARY_IMPL and _FRAGMENT, which may share a namespace, name theirs otherwise.
# These are local symbols, in the symbol table only, which strip (and --strip-all,
# --strip-unneeded) removes.
_DEFINITION = re.compile(rb"(\d+)(TORCH_LIBRARY_static_init_\w+)")
_DEFINITION_PREFIX = len(b"TORCH_LIBRARY_static_init_")
_REGISTRATION = re.compile(rb"TORCH_LIBRARY(?:_IMPL|_FRAGMENT)?_static_init_")


def defined_namespaces(path: str | os.PathLike) -> frozenset[str] | None:
    """The namespaces a library binary defines with ``TORCH_LIBRARY``, read from its
    symbol table; None where it has none (stripped, or registering without torch's
    macros) or cannot be read (a loaded library whose file is gone)."""
    try:
        return _defined_namespaces(str(path), os.path.getmtime(path))
    except OSError:
        return None


@lru_cache(maxsize=32)
def _defined_namespaces(path: str, mtime: float) -> frozenset[str] | None:
    strings = _strings(path, mtime)
    if not any(_REGISTRATION.search(string) for string in strings):
        return None
    names = set()
    for string in strings:
        for length, name in _DEFINITION.findall(string):
            if int(length) <= len(name):
                names.add(name[_DEFINITION_PREFIX : int(length)].decode())
    return frozenset(names)


def load_all(paths: Iterable[str | os.PathLike]) -> list[Path]:
    return [load(path) for path in paths]


def is_user_operator(name: str) -> bool:
    namespace, _, _ = name.partition("::")
    return "::" in name and not is_builtin(namespace)


def operators_called(module, example_args: tuple | None = None) -> set[str]:
    """The user's operators ``module`` calls: from the graph of a TorchScript module or
    an exported program, else recorded while it runs on ``example_args``."""
    return {name for name in all_operators_called(module, example_args) if is_user_operator(name)}


def all_operators_called(module, example_args: tuple | None = None) -> set[str]:
    """Every operator ``module`` calls (torch's and torchvision's too), found as
    ``operators_called`` finds the user's."""
    if isinstance(module, torch.export.ExportedProgram):
        module = module.graph_module
    if isinstance(module, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        graph = module.inlined_graph if hasattr(module, "inlined_graph") else module.graph
        names = _graph_kinds(graph)
    elif isinstance(module, torch.fx.GraphModule):
        names = {_qualified(node.target) for node in module.graph.nodes}
    elif example_args is not None:
        names = _recorded(module, example_args)
    else:
        names = set()
    return {name for name in names if name and "::" in name}


def _graph_kinds(graph) -> set[str]:
    kinds = set()
    for node in graph.nodes():
        kinds.add(node.kind())
        for block in node.blocks():
            kinds |= _graph_kinds(block)
    return kinds


def _qualified(target) -> str | None:
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


def _recorded(module, example_args: tuple) -> set[str]:
    with torch.no_grad(), recording() as seen:
        module(*example_args)
    return seen


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """The operators dispatched inside the block (TorchScript's included), as a set
    that fills as they run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._schema.name)
            args, kwargs = _numbers_as_given(func, args, kwargs or {})
            return func(*args, **kwargs)

    with Record():
        yield seen


# The dtype of the tensor torch wraps a Python number in (a "wrapped number").
_WRAPPED_DTYPES = {
    bool: torch.bool,
    int: torch.int64,
    float: torch.float64,
    complex: torch.complex128,
}


def _numbers_as_given(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of ``func`` as the caller gave them. torch hands a dispatch mode a
    wrapped number (the tensor a trace holds for ``x * 100``, a TorchScript
    ``NumToTensor``) as a Python number, and calling ``func`` with it fails unless the
    operator takes numbers for tensors (``add``, ``mul``, ...): a fresh TorchScript
    model, whose first call folds such a constant with ``_local_scalar_dense``, failed
    under the recording. The number becomes the CPU tensor of one element it was."""
    positions = _tensor_parameters(func)
    if not positions:
        return args, kwargs
    args = list(args)
    for position, name in positions:
        if position < len(args):
            args[position] = _as_tensor(args[position])
        elif name in kwargs:
            kwargs = {**kwargs, name: _as_tensor(kwargs[name])}
    return tuple(args), kwargs


@cache
def _tensor_parameters(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each parameter of ``func`` that holds tensors, unless the
    operator takes numbers for them itself."""
    if torch._C._should_allow_numbers_as_tensors(func._schema.name.split("::")[-1]):
        return ()
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(func._schema.arguments)
        if _holds_tensors(argument.type)
    )


def _holds_tensors(kind) -> bool:
    if isinstance(kind, torch._C.TensorType):
        return True
    if isinstance(kind, (torch._C.OptionalType, torch._C.ListType)):
        return _holds_tensors(kind.getElementType())
    return False


def _as_tensor(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_as_tensor(each) for each in value)
    dtype = _WRAPPED_DTYPES.get(type(value))
    return value if dtype is None else torch.tensor(value, dtype=dtype)


# The dispatcher's refusal of an operator with no kernel for its inputs' device.
_NO_KERNEL = re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<key>\w+)'")
# A kernel in torch._C._dispatch_dump: "CPU: registered at ...", "Autograd[alias]: ...".
_KERNEL = re.compile(r"^(?P<key>\w+)(?:\[alias\])?: registered at ", re.MULTILINE)


def kernel_error(error: BaseException) -> BladesmithError | None:
    """One line for the dispatcher's error when one of the user's operators has no kernel
    for the device the model ran on: the operator, its library, the kernels it has (the
    error itself lists every fallback); None for any other error."""
    match = _NO_KERNEL.search(str(error))
    if match is None or not is_user_operator(match.group("op")):
        return None
    operator, key = match.group("op", "key")
    library = _library_defining(operator)
    origin = f" in {library.name}" if library else ""
    dump = torch._C._dispatch_dump(operator)
    kernels = sorted({k for k in _KERNEL.findall(dump) if k != "debug"})
    has = f"it has: {', '.join(kernels)}" if kernels else "it has a schema and no kernel"
    return BladesmithError(
        f"{operator} has no {key} kernel{origin} ({has}): register one "
        f"(TORCH_LIBRARY_IMPL({operator.split('::')[0]}, {key}, m)), or optimize for a "
        "device it has one for"
    )


def has_fake_kernel(name: str) -> bool:
    """Whether operator ``name`` can run on fake tensors (``torch.library.register_fake``
    or a Meta kernel): what ``torch.export`` and Inductor need to trace through it."""
    from torch._library import simple_registry

    entry = simple_registry.singleton.find(name)
    if entry.fake_impl.kernel is not None:
        return True
    return any(
        torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
        for key in ("Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd")
    )


def without_fake_kernel(operators: Iterable[str]) -> list[str]:
    return sorted(name for name in operators if not has_fake_kernel(name))


def libraries_of(operators: Iterable[str]) -> list[Library]:
    """The loaded libraries (``torch.ops.loaded_libraries``) the operators come from.
    Operators registered from Python (``torch.library``) belong to no library and are
    left out: the code that registers them must run again where the model loads."""
    by_path: dict[Path, list[str]] = {}
    for name in sorted(operators):
        path = _library_defining(name)
        if path is not None:
            by_path.setdefault(path, []).append(name)
    return [Library(path, tuple(names)) for path, names in by_path.items()]


def _library_defining(name: str) -> Path | None:
    namespace, _, op = name.partition("::")
    op = op.split(".")[0]
    for loaded in sorted(torch.ops.loaded_libraries):
        strings = _strings(loaded, os.path.getmtime(loaded))
        if namespace.encode() in strings and op.encode() in strings:
            return Path(loaded)
    return None


@lru_cache(maxsize=32)
def _strings(path: str, mtime: float) -> frozenset[bytes]:
    """The identifier-like strings in a binary (its registration names among them)."""
    data = Path(path).read_bytes()
    return frozenset(re.findall(rb"[A-Za-z_][A-Za-z0-9_]{2,}", data))


def folder_beside(artifact: str | os.PathLike) -> Path:
    artifact = Path(artifact)
    return artifact.with_name(artifact.name + _FOLDER_SUFFIX)


def stored(artifact: str | os.PathLike) -> Path | None:
    """The folder of libraries ``store_needed`` wrote beside ``artifact``, or None."""
    folder = folder_beside(artifact)
    return folder if (folder / _INDEX).is_file() else None


def store_needed(called: set[str], folder: Path) -> list[dict]:
    """All that saving asks of the user's operator libraries: the user's operators among
    ``called`` (``all_operators_called``; what a format refuses of them it says itself,
    ``Format.refuses_operators``); the libraries they come from copied into ``folder`` (a
    new, empty one) with an index; their entries for the artifact's metadata: file,
    operators, SHA-256 (``restore`` loads nothing else)."""
    operators = {name for name in called if is_user_operator(name)}
    libraries = libraries_of(operators)
    names = [library.path.name for library in libraries]
    if len(set(names)) < len(names):
        raise BladesmithError(f"save: two operator libraries share a file name ({names})")
    entries = []
    for library in libraries:
        shutil.copy2(library.path, folder / library.path.name)
        entries.append(
            {
                "file": library.path.name,
                "operators": list(library.operators),
                "sha256": _sha256(folder / library.path.name),
            }
        )
    if entries:
        (folder / _INDEX).write_text(json.dumps(entries, indent=2) + "\n")
    return entries


def restore(artifact: str | os.PathLike, entries: list[dict], *, trust: bool = False) -> None:
    """Load the libraries beside ``artifact`` that ``entries`` (the artifact's own
    metadata) record, unless their operators are loaded already (the user loaded them:
    a second copy would register them twice). The folder must hold those and the index
    alone, each a file of the folder (no link out of it) with the recorded SHA-256, the
    index agreeing: anything else is refused in one line naming the file. Loading a
    library runs its code: only when ``trust`` (the record protects a genuine artifact
    from a swapped folder, not from the artifact's maker)."""
    artifact = Path(artifact).resolve()  # a link to an artifact: its libraries are there
    folder = folder_beside(artifact)
    source = f"{artifact}: its library"
    for entry in entries:
        name = entry.get("file", "")
        if Path(name).name != name or name in ("", ".", ".."):
            raise BladesmithError(
                f"{source} {name!r} is not a file name in {folder.name}/: refused (a "
                "library is loaded from the folder beside the artifact only)"
            )
    _check_folder(artifact, folder, entries)
    for entry in entries:
        missing = [op for op in entry["operators"] if not _registered(op)]
        if not missing:
            continue
        path = folder / entry["file"]
        if not path.is_file():
            raise BladesmithError(missing_message(artifact, missing[0], entry["file"]))
        if path.is_symlink() or path.resolve().parent != folder.resolve():
            raise BladesmithError(f"{source} {path} is a link out of {folder.name}/: refused")
        if entry.get("sha256") is None:
            raise BladesmithError(
                f"{source} {path} has no SHA-256 in the artifact's metadata (saved by an "
                f"older bladesmith): save it again, or load the library with {LIBRARY_FLAG}"
            )
        if _sha256(path) != entry["sha256"]:
            raise BladesmithError(
                f"{source} {path} is not the file saved with it (its SHA-256 differs): "
                "refused; save the artifact again"
            )
        require(artifact, f"the native library {folder.name}/{entry['file']}", trust)
        load(path, source)


def _check_folder(artifact: Path, folder: Path, entries: list[dict]) -> None:
    """One line for a folder of libraries that is not what ``entries`` record."""
    if not (folder.exists() or folder.is_symlink()):
        return
    if not folder.resolve().is_relative_to(artifact.parent):
        raise BladesmithError(f"{folder}: a link out of {artifact.parent}: refused")
    recorded = {entry["file"] for entry in entries}
    for path in sorted(folder.iterdir()):
        if path.name != _INDEX and path.name not in recorded:
            raise BladesmithError(
                f"{path}: not a library {artifact.name} records: refused (remove it, or "
                "save the artifact again)"
            )
    index = folder / _INDEX
    try:
        listed = json.loads(index.read_text()) if index.is_file() else entries
    except ValueError:
        listed = None
    if listed != entries:
        raise BladesmithError(
            f"{index}: not the libraries {artifact.name} records: refused (save the artifact again)"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _registered(name: str) -> bool:
    return bool(torch._C._jit_get_schemas_for_operator(name))


def missing_message(source, operator: str, library: str | None = None) -> str:
    """One line: ``source`` needs ``operator``, from ``library`` when known, and what the
    user's loaded libraries define instead."""
    origin = f" ({library})" if library else ""
    return (
        f"{source}: operator {operator} is not loaded; pass its library{origin} with "
        f"{LIBRARY_FLAG} PATH (Python: torch.ops.load_library(PATH) first)"
        f"{_loaded_instead(operator)}"
    )


def _loaded_instead(operator: str) -> str:
    """What the loaded libraries of other namespaces than torch's and bladesmith's
    define, where ``operator`` is not registered: the wrong library given, or another
    version of the right one."""
    namespace, _, name = operator.partition("::")
    notes = []
    for loaded in sorted(torch.ops.loaded_libraries):
        defined = {each for each in defined_namespaces(loaded) or () if not is_builtin(each)}
        if namespace in defined:
            notes.append(f"{Path(loaded).name} defines {namespace} without {name}")
        elif defined:
            spaces = ", ".join(f"{each}::*" for each in sorted(defined))
            notes.append(f"{Path(loaded).name} defines {spaces} only")
    return f"; of the libraries loaded, {'; '.join(notes)}" if notes else ""


def library_named(entries: list[dict], operator: str) -> str | None:
    """The file that registers ``operator``, from an artifact's ``libraries`` entries."""
    return next((e["file"] for e in entries if operator in e["operators"]), None)


# TorchScript's refusal of a call that the loaded operator's schema does not take: the
# schema and a colon, why on the next line, and the call's line marked "<--- HERE" below.
_REFUSED_CALL = re.compile(
    r"^\s*(?P<op>\w+::\w+)(?:\.\w+)?\(.*\) -> .*:\n\s*(?P<why>.+?)\.?$", re.MULTILINE
)
_MARKED_LINE = re.compile(r"^\s*(?P<line>\S.*)\n\s*~+ <--- HERE", re.MULTILINE)


def operator_error(error: BaseException, source, entries=()) -> BladesmithError | None:
    """For TorchScript's error while loading ``source``: one line for an operator that is
    not loaded ("Unknown builtin op"; its library when ``entries``, an artifact's, know
    it) and for a call the loaded operator's schema does not take (another version of
    its library); None for any other error."""
    text = str(error)
    match = _UNKNOWN_OP.search(text)
    if match is not None:
        operator = match.group("op")
        return BladesmithError(missing_message(source, operator, library_named(entries, operator)))
    match = _REFUSED_CALL.search(text)
    if match is None or not is_user_operator(match.group("op")):
        return None
    operator = match.group("op")
    library = _library_defining(operator)
    origin = f" in {library}" if library else ""
    schemas = "; ".join(map(str, torch._C._jit_get_schemas_for_operator(operator)))
    call = _MARKED_LINE.search(text)
    called = f" `{call.group('line').strip()}`" if call else ""
    return BladesmithError(
        f"{source}: the schema of {operator}{origin}, {schemas}, does not take the "
        f"model's call{called} ({match.group('why')}): load the version of the library "
        "that the model was made with"
    )
