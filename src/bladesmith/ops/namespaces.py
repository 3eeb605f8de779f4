"""Whose an operator namespace is: torch's, torchvision's and bladesmith's own, or the
user's.

The dispatcher records where each operator and kernel was registered: a C++ file under
the source tree its library was built from, or a Python file. A namespace is built in
when one of those places is torch's or torchvision's source tree, or a Python module of
torch, torchvision or bladesmith (torch registers namespaces lazily, as its modules
import: ``quantized_decomposed``, ``symm_mem``, ``_native``, ...); torch's registration
helpers (``torch.library``, ``torch._library``) say nothing of the caller and are
skipped, and an operator from ``torch.library.custom_op`` names its defining module
instead. The fixed set below names namespaces known to be theirs without a lookup:
the common ones, and what the dispatcher cannot tell: TorchScript's node kinds
(``prim::``, ``onnx::``), higher-order operators, and the few namespaces torch defines
through its helpers alone or without saying where (``coor``, ``_test``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import torch

_FIXED = frozenset(
    {
        "aten",
        "prim",
        "prims",
        "onnx",
        "quantized",
        "_quantized",
        "mkldnn",
        "mkl",
        "cudnn",
        "profiler",
        "debugprims",
        "rngprims",
        "higher_order",
        "inductor",
        "c10d",
        "_c10d_functional",
        "_dtensor",
        "coor",
        "_test",
        "torchvision",
        "image",
        "bladesmith",
    }
)
_REGISTERED_AT = re.compile(r"registered at (\S+?)(?::\d+)?(?: |$)", re.MULTILINE)
_HELPERS = ("torch/library.py", "torch/_library/")
_PACKAGES = ("torch", "torchvision", "bladesmith")

# namespace -> whether torch, torchvision or bladesmith registers it, and whether from
# C++ (compiled into their libraries) or from Python only.
_origins: dict[str, tuple[bool, bool]] = {}


def is_builtin(namespace: str) -> bool:
    """Whether ``namespace`` is torch's, torchvision's or bladesmith's. A namespace with
    no operator registered here (a library not loaded yet) is taken for the user's."""
    return namespace in _FIXED or _origin(namespace)[0]


def registered_from_python_only(namespace: str) -> bool:
    """Whether ``namespace`` is torch's (or torchvision's) but registered from Python
    alone: a process that runs TorchScript without Python (Triton's libtorch backend)
    does not have it."""
    builtin, compiled = _origin(namespace)
    return namespace not in _FIXED and builtin and not compiled


def _origin(namespace: str) -> tuple[bool, bool]:
    origin = _origins.get(namespace)
    if origin is None:
        places = _registered_places(namespace)
        if not places:
            return False, False  # not decided for good: it may be registered later
        compiled = [place.startswith(_source_roots()) for place in places]
        python = [_in_packages(place) for place in places]
        origin = _origins[namespace] = (any(compiled) or any(python), any(compiled))
    return origin


def _registered_places(namespace: str) -> list[str]:
    """Where the operators of ``namespace`` and their kernels were registered (files, or
    for ``custom_op`` the defining module), torch's registration helpers left out."""
    from torch._library.custom_ops import OPDEFS

    places = []
    for name in operators_in(namespace):
        places += _REGISTERED_AT.findall(torch._C._dispatch_dump(name))
        definition = OPDEFS.get(name.split(".")[0])
        if definition is not None:
            places.append(definition._init_fn.__module__)
    return [place for place in places if not any(helper in place for helper in _HELPERS)]


def operators_in(namespace: str) -> list[str]:
    """The operators (with their overloads) registered in ``namespace`` in this process."""
    prefix = f"{namespace}::"
    return [name for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)]


def _in_packages(place: str) -> bool:
    """Whether ``place`` (a file or a module name) is torch's, torchvision's or
    bladesmith's Python."""
    if "/" not in place:
        return place.partition(".")[0] in _PACKAGES
    return place.startswith(_package_folders())


@lru_cache(maxsize=1)
def _source_roots() -> tuple[str, ...]:
    """The source trees torch's and torchvision's C++ was built from, as their own
    registrations name them."""
    try:
        import torchvision  # noqa: F401 - registers torchvision's operators
    except ImportError:
        pass
    roots = [
        _source_root("aten::add.Tensor", "/aten/src/", "/build"),
        _source_root("torchvision::nms", "/torchvision/csrc/", ""),
    ]
    return tuple(f"{root.rstrip('/')}/" for root in roots if root)


@lru_cache(maxsize=1)
def _package_folders() -> tuple[str, ...]:
    import importlib.util

    folders = []
    for package in _PACKAGES:
        found = importlib.util.find_spec(package)
        if found is not None and found.origin:
            folders.append(f"{Path(found.origin).parent}/")
    return tuple(folders)


def _source_root(operator: str, marker: str, build: str) -> str:
    """The source tree ``operator``'s library was built from: its registration's path
    up to ``marker``, less a trailing ``build`` folder ("" where it is not registered)."""
    try:
        places = _REGISTERED_AT.findall(torch._C._dispatch_dump(operator))
    except RuntimeError:
        return ""
    for place in places:
        if marker in place:
            root = place[: place.index(marker)]
            return root.removesuffix(build) if build else root
    return ""
