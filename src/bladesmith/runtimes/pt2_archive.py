"""What a ``.pt2`` archive holds, read from the ZIP without running any of it.

torch's reader (``load_pt2``, behind ``torch.export.load`` and ``load_package``)
unpickles a torch.export program's sample inputs, its tensor subclasses and its opaque
constants with ``weights_only=False``: a crafted file runs any Python it likes there.
``unsafe_pickle`` finds those pickles first (by the archive's own payload configs, as
torch's reader finds them) and tries each with torch's ``weights_only`` unpickler, which
builds tensors and containers only; ``aoti_models`` and ``member`` let ``bladesmith.load``
read an AOTInductor package without torch's Python reader at all.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import torch

# torch's names for the archive's parts (torch.export.pt2_archive.constants).
_MODELS = "models/"
_AOTI = "data/aotinductor/"
_SAMPLE_INPUTS = "data/sample_inputs/{}.pt"
_CONFIGS = (  # (config file, the folder its payloads lie in)
    ("data/weights/{}_weights_config.json", "data/weights/"),
    ("data/constants/{}_constants_config.json", "data/constants/"),
)
_LEGACY = ("data/weights/{}.pt", "data/constants/{}.pt")  # one pickle per model
# Constants torch unpickles as objects, whatever is in them (torchbind, plain pickle).
_OBJECT_PREFIXES = ("custom_obj_", "opaque_obj_")


def members(path: str | Path) -> dict[str, str]:
    """The archive's member names without its root folder (torch's reader strips it),
    each to its full name in the ZIP."""
    with zipfile.ZipFile(path) as archive:
        return {name.partition("/")[2]: name for name in archive.namelist() if "/" in name}


def member(path: str | Path, name: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(members(path)[name])


def aoti_models(names) -> list[str]:
    """The AOTInductor models' names among an archive's ``members``."""
    return sorted({name[len(_AOTI) :].split("/")[0] for name in names if name.startswith(_AOTI)})


def exported_programs(names) -> list[str]:
    """The torch.export programs' names among an archive's ``members``."""
    return sorted(
        name[len(_MODELS) : -len(".json")]
        for name in names
        if name.startswith(_MODELS) and name.endswith(".json")
    )


def aoti_metadata(path: str | Path, key: str) -> str | None:
    """The value of ``key`` in the metadata an AOTInductor package's first model was
    compiled with (``aot_inductor.metadata``), read from its JSON, or None."""
    names = members(path)
    prefix = f"{_AOTI}model/"
    for name in sorted(names):
        if name.startswith(prefix) and name.endswith("_metadata.json"):
            value = json.loads(member(path, name)).get(key)
            if value is not None:
                return value
    return None


def unsafe_pickle(path: str | Path) -> str | None:
    """The first pickle in ``path`` that torch's reader would unpickle and that is not
    tensors in containers (named, with why), or None."""
    names = members(path)
    with zipfile.ZipFile(path) as archive:

        def read(name: str) -> bytes:
            return archive.read(names[name])

        for model in exported_programs(names):
            pickles = [_SAMPLE_INPUTS.format(model), *(f.format(model) for f in _LEGACY)]
            for config_name, folder in _CONFIGS:
                config_name = config_name.format(model)
                if config_name not in names:
                    continue
                for fqn, payload in json.loads(read(config_name)).get("config", {}).items():
                    file = str(payload.get("path_name", ""))
                    if file.startswith(_OBJECT_PREFIXES):
                        return f"{folder}{file} ({fqn}): a pickled object, not a tensor"
                    if payload.get("use_pickle"):
                        pickles.append(folder + file)
            for name in pickles:
                if name in names and not _only_tensors(read(name)):
                    return f"{name}: a pickle of more than tensors"
    return None


def _only_tensors(data: bytes) -> bool:
    """Whether torch's ``weights_only`` unpickler (tensors, containers and plain values,
    nothing called that it does not know) reads ``data``."""
    if not data:
        return True  # torch reads an empty payload as nothing
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception:
        return False
    return True
