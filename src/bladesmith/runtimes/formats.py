"""The saved formats, by suffix: each a ``format.Format`` filled by one module of
``runtimes``, which writes, reads and runs it. ``artifact.save`` and ``artifact.load``,
the engine, the CLI and ``export triton`` ask ``FORMATS`` which formats exist and what
each takes.

``write`` puts a file and its operator libraries in place together, ``metadata_of`` and
``read`` take them back, saying in one line why a file cannot be.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from bladesmith._files import contents, first_line, replacing, unreadable
from bladesmith.errors import BladesmithError, MissingFileError, NotAnArtifactError
from bladesmith.ops import libraries
from bladesmith.runtimes import aoti, compiled_program, onnxruntime, openvino, torchscript
from bladesmith.runtimes.format import Format
from bladesmith.trust import UntrustedFileError

FORMATS: dict[str, Format] = {
    each.suffix: each
    for each in (
        aoti.FORMAT,
        compiled_program.FORMAT,
        torchscript.FORMAT,
        onnxruntime.FORMAT,
        openvino.FORMAT,
    )
}

METADATA_KEY = (
    "bladesmith"  # in AOTInductor metadata, TorchScript extra files, ONNX properties, ZIPs
)


def metadata_of(path: Path) -> dict:
    """bladesmith's metadata in the artifact at ``path``, read without loading its model;
    one line for a file that is not one."""
    problem = unreadable(path)
    if problem:
        error = MissingFileError if not path.exists() else BladesmithError
        raise error(f"load: {str(path)!r}: {problem}")
    if path.suffix not in FORMATS:
        known = ", ".join(FORMATS)
        raise BladesmithError(f"load: {str(path)!r} has an unknown suffix; expected {known}")
    # torch's loaders log their failures before raising: say it here, in one line.
    if FORMATS[path.suffix].zip_archive and not zipfile.is_zipfile(path):
        raise cannot_load(path, "not a ZIP archive")
    try:
        metadata = FORMATS[path.suffix].metadata(path, METADATA_KEY)
        info = json.loads(metadata) if metadata is not None else None
    except Exception as error:  # zipfile, protobuf and json each raise their own
        raise cannot_load(path, first_line(error)) from error
    if not isinstance(info, dict):
        raise NotAnArtifactError(
            f"load: {str(path)!r} has no bladesmith metadata: it was not written by "
            "bladesmith.save (load it with torch.jit.load, aoti_load_package or "
            "bladesmith.onnx.session)"
        )
    return info


def cannot_load(path: Path, why: str, hint: str = "") -> BladesmithError:
    return BladesmithError(
        f"load: cannot load {str(path)!r}, {contents(path)} ({why}){hint}; "
        "bladesmith reads the artifacts that bladesmith.save and optimize --out write"
    )


def write(module, calls: list[tuple], path: Path, metadata: dict, form: str, **options) -> None:
    """``module`` in format ``form`` (a suffix) at ``path``, with the user's operator
    libraries it calls (``ops.libraries.store_needed``) in the folder beside it: both
    written beside their targets, then put in place together (``_files.replacing``)."""
    runtime = FORMATS[form]
    with replacing(path, libraries.folder_beside(path)) as (file, folder):
        called = libraries.all_operators_called(module, calls[0])
        refused = runtime.refuses_operators(
            {name for name in called if libraries.is_user_operator(name)}
        )
        if refused:
            raise BladesmithError(f"save: {form} refused: {refused}")
        metadata["libraries"] = libraries.store_needed(called, folder)
        metadata["torchvision_operators"] = any(name.startswith("torchvision::") for name in called)
        runtime.write(module, calls, file, metadata, key=METADATA_KEY, name=path.name, **options)


def read(path: Path, info: dict, trust: bool = False):
    """The runner (or runners) of the artifact at ``path`` whose metadata is ``info``,
    after bladesmith's operators and the libraries the metadata records (checked:
    ``ops.libraries.restore``); one line for a file that does not load. What would run
    code the file brings (a library, compiled code, TorchScript outside the operator
    allowlist) is refused unless ``trust`` (``bladesmith.trust``)."""
    from bladesmith import ops

    missing = FORMATS[path.suffix].missing_package()
    if missing:
        raise BladesmithError(f"load: cannot load {str(path)!r}: {missing}")
    # Importing torchvision (1.2 s of a 1.6 s load on a 2-core CPU) registers its
    # operators: an artifact written before this was recorded may call them.
    ops_error = ops.load_builtin(torchvision=info.get("torchvision_operators", True) is not False)
    libraries.restore(path, info.get("libraries", []), trust=trust)
    try:
        return FORMATS[path.suffix].read(path, info, trust=trust)
    except Exception as error:  # torch, protobuf and zipfile each raise their own
        if aoti.DEVICE_ERROR in str(error) or isinstance(error, UntrustedFileError):
            raise
        operator = libraries.operator_error(error, path, info.get("libraries", []))
        if operator is not None:
            raise operator from None
        hint = f"; bladesmith's custom operators did not load: {ops_error}" if ops_error else ""
        raise cannot_load(path, first_line(error), hint) from error


def in_order(device) -> list[str]:
    """Every suffix, those first on ``device``'s kind first."""
    return sorted(FORMATS, key=lambda suffix: device.type not in FORMATS[suffix].first_on)


def listing() -> str:
    """The suffixes with what each holds, for messages."""
    return ", ".join(f"{suffix} ({each.description})" for suffix, each in FORMATS.items())


def save_hint(spec) -> str:
    """How to save a result whose spec is ``spec``, in its best verified format."""
    if not spec.save_formats:
        refused = "; ".join(f"{k}: {why}" for k, why in spec.refused_formats.items())
        return f"no format was saved and loaded with the same outputs ({refused})"
    suffix = spec.save_formats[0]
    return f'bladesmith.save(optimized, "model{suffix}"): {FORMATS[suffix].description}'
