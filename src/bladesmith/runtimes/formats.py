"""The saved formats, by suffix: the module of ``runtimes`` that writes, reads and runs
each. ``artifact.save`` and ``artifact.load`` dispatch through ``FORMATS``.

Each module has ``SUFFIX``; ``NEEDS_FAKE_KERNELS`` (it traces the operators on fake
tensors); ``write(module, calls, path, metadata, key=..., **options)``, which writes
``path`` and completes ``metadata`` with what its reader needs; ``metadata(path, key)``,
bladesmith's metadata as JSON read without loading the model (or None); and
``read(path, info)``, the runner (or {BuiltFor: runner} for a file of several models).
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
from bladesmith.runtimes import aoti, onnxruntime, torchscript
from bladesmith.trust import UntrustedFileError

FORMATS = {each.SUFFIX: each for each in (aoti, torchscript, onnxruntime)}

METADATA_KEY = "bladesmith"  # in AOTInductor metadata, TorchScript extra files, ONNX properties


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
    if path.suffix != onnxruntime.SUFFIX and not zipfile.is_zipfile(path):
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
        fake_kernels_for = runtime.SUFFIX if runtime.NEEDS_FAKE_KERNELS else None
        called = libraries.all_operators_called(module, calls[0])
        metadata["libraries"] = libraries.store_needed(
            called, folder, fake_kernels_for=fake_kernels_for
        )
        metadata["torchvision_operators"] = any(name.startswith("torchvision::") for name in called)
        runtime.write(module, calls, file, metadata, key=METADATA_KEY, name=path.name, **options)


def read(path: Path, info: dict, trust: bool = False):
    """The runner (or runners) of the artifact at ``path`` whose metadata is ``info``,
    after bladesmith's operators and the libraries the metadata records (checked:
    ``ops.libraries.restore``); one line for a file that does not load. What would run
    code the file brings (a library, compiled code, TorchScript outside the operator
    allowlist) is refused unless ``trust`` (``bladesmith.trust``)."""
    from bladesmith import ops

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
