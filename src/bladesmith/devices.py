"""Device discovery and choice: CUDA, then DirectML, then Apple MPS, then CPU.

``resolve_device`` returns a plain ``torch.device`` so callers pass it straight to
``.to()``; ``device_kind`` maps one back to bladesmith's kinds ("cuda", "dml", "mps",
"cpu"), DirectML tensors living on torch's "privateuseone" device. Everything is
detected when called, through ``torch.cuda``, ``torch.backends.mps`` and an import of
``torch_directml``, so tests can monkeypatch those without the hardware.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from bladesmith.errors import DeviceUnavailableError

KINDS = ("cuda", "dml", "mps", "cpu")  # also the order "auto" tries them in
_KIND_OF_TORCH_TYPE = {"cuda": "cuda", "privateuseone": "dml", "mps": "mps", "cpu": "cpu"}
_NAME = re.compile(r"(?P<kind>[a-z]+)(?::(?P<index>\d+))?")
_EXPECTED = "'auto', 'cuda', 'cuda:N', 'gpu', 'dml', 'dml:N', 'mps', 'cpu' or a torch.device"
_ALIASES = {"gpu": "cuda"}  # PAI-Blade's device_type names a GPU "gpu"


@dataclass(frozen=True)
class DeviceInfo:
    """One device found here; ``name`` is what ``resolve_device`` accepts."""

    name: str
    kind: str
    description: str
    total_memory: int | None = None  # bytes
    compute_capability: str | None = None  # CUDA only, "major.minor"
    logical_cores: int | None = None  # CPU only
    torch_threads: int | None = None  # CPU only

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The torch.device for ``name``; "auto" picks the best one here (see ``KINDS``).

    Raises DeviceUnavailableError naming what is missing when ``name`` cannot be used.
    """
    if isinstance(name, str) and name.strip().lower() == "auto":
        for kind in KINDS[:-1]:
            try:
                return _RESOLVERS[kind](None, kind)
            except DeviceUnavailableError:
                continue
        return torch.device("cpu")
    kind, index = _parse(name)
    return _RESOLVERS[kind](index, _label(kind, index))


def device_kind(device: str | torch.device) -> str:
    """ "cuda", "dml", "mps" or "cpu" for a device name or torch.device."""
    return _parse(device)[0]


def with_index(device: str | torch.device) -> torch.device:
    """ "cuda" -> "cuda:N", the current GPU (when there is one), as tensors name their
    device, so that device checks compare equal; any other device as given."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def available_devices() -> list[DeviceInfo]:
    """Every usable device here, best first, the CPU always last."""
    return [*_cuda_devices(), *_directml_devices(), *_mps_devices(), _cpu_device()]


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    # x86 names its CPU in "model name" ("model" is a number there); ARM boards use the others.
    for key in ("model name", "hardware", "model"):
        if fields.get(key):
            return fields[key]
    return platform.processor() or platform.machine() or "unknown CPU"


def _parse(device: str | torch.device) -> tuple[str, int | None]:
    if isinstance(device, torch.device):
        kind, index = _KIND_OF_TORCH_TYPE.get(device.type), device.index
    elif isinstance(device, str):
        match = _NAME.fullmatch(device.strip().lower())
        kind = match and _ALIASES.get(match["kind"], match["kind"])
        index = int(match["index"]) if match and match["index"] else None
    else:
        raise DeviceUnavailableError(
            f"device: expected {_EXPECTED}, got {type(device).__name__} {device!r}"
        )
    if kind not in KINDS:
        raise DeviceUnavailableError(f"device: expected {_EXPECTED}, got {str(device)!r}")
    return kind, index


def _label(kind: str, index: int | None) -> str:
    return kind if index is None else f"{kind}:{index}"


def _index_error(requested: str, kind: str, count: int, what: str) -> DeviceUnavailableError:
    names = ", ".join(f"{kind}:{i}" for i in range(count))
    plural = "" if count == 1 else "s"
    return DeviceUnavailableError(
        f"{requested} requested but this machine has {count} {what} device{plural} ({names})"
    )


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resolve_cuda(index: int | None, requested: str) -> torch.device:
    count = _cuda_count()
    if count == 0:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise DeviceUnavailableError(
                f"{requested} requested but torch was built without CUDA "
                f"(torch {torch.__version__}); install a CUDA build from "
                "https://pytorch.org/get-started/locally/"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = (
            f"CUDA_VISIBLE_DEVICES={visible!r} may hide them"
            if visible is not None
            else "check the NVIDIA driver with nvidia-smi"
        )
        raise DeviceUnavailableError(
            f"{requested} requested but torch {torch.__version__} sees no CUDA GPU; {hint}"
        )
    if index is None:
        return torch.device("cuda")
    if index >= count:
        raise _index_error(requested, "cuda", count, "CUDA")
    return torch.device("cuda", index)


def _load_directml():
    """The torch_directml module; DeviceUnavailableError says why it cannot be had."""
    try:
        return importlib.import_module("torch_directml")
    except ImportError as error:
        if error.name == "torch_directml":
            raise DeviceUnavailableError(
                "DirectML needs the torch-directml package: pip install torch-directml"
            ) from None
        raise DeviceUnavailableError(f"torch-directml fails to import: {error}") from error
    except OSError as error:  # its DirectML DLL does not load
        raise DeviceUnavailableError(f"torch-directml fails to import: {error}") from error


def _resolve_directml(index: int | None, requested: str) -> torch.device:
    dml = _load_directml()
    count = dml.device_count()
    if count == 0:
        raise DeviceUnavailableError(
            f"{requested} requested but torch-directml finds no DirectML device "
            "(it needs Windows 10+ or WSL2 and a DirectX 12 GPU driver)"
        )
    if index is None:
        index = dml.default_device()
    elif index >= count:
        raise _index_error(requested, "dml", count, "DirectML")
    return torch.device(dml.device(index))


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _resolve_mps(index: int | None, requested: str) -> torch.device:
    if not _mps_available():
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_built():
            reason = f"torch {torch.__version__} was built without MPS"
        else:
            reason = "MPS is not available (it needs macOS 12.3+ on Apple silicon)"
        raise DeviceUnavailableError(f"{requested} requested but {reason}")
    if index not in (None, 0):
        raise _index_error(requested, "mps", 1, "MPS")
    return torch.device("mps")


def _resolve_cpu(index: int | None, requested: str) -> torch.device:
    return torch.device("cpu")


_RESOLVERS = {
    "cuda": _resolve_cuda,
    "dml": _resolve_directml,
    "mps": _resolve_mps,
    "cpu": _resolve_cpu,
}


def _cuda_devices() -> list[DeviceInfo]:
    devices = []
    for index in range(_cuda_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            DeviceInfo(
                name=f"cuda:{index}",
                kind="cuda",
                description=props.name,
                total_memory=props.total_memory,
                compute_capability=f"{props.major}.{props.minor}",
            )
        )
    return devices


def _directml_devices() -> list[DeviceInfo]:
    try:
        dml = _load_directml()
    except DeviceUnavailableError:
        return []
    return [
        DeviceInfo(name=f"dml:{index}", kind="dml", description=dml.device_name(index))
        for index in range(dml.device_count())
    ]


def _mps_devices() -> list[DeviceInfo]:
    if not _mps_available():
        return []
    return [DeviceInfo(name="mps", kind="mps", description="Apple GPU (Metal)")]


def _cpu_device() -> DeviceInfo:
    return DeviceInfo(
        name="cpu",
        kind="cpu",
        description=cpu_model(),
        logical_cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
    )


def moved_to(device: torch.device, tree):
    """``tree`` (nested arguments) with every tensor on ``device``; ``tree`` itself when
    all are there already: the usual case, checked without pytree's cost."""
    from torch.utils import _pytree as pytree

    from bladesmith.bench import iter_tensors

    home = with_index(device)  # as tensors report it
    if all(tensor.device == home for tensor in iter_tensors(tree)):
        return tree
    return pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != home else x, tree
    )
