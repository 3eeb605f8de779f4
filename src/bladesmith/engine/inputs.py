"""What ``optimize`` is given, made uniform: the model (a module, a TorchScript module, a
torch.export program, or a file of either) as a private copy in eval mode on the device,
and the test data as a list of argument tuples."""

from __future__ import annotations

import contextlib
import copy
import os
import zipfile

import torch
from torch import nn

from bladesmith._files import contents, first_line, unreadable
from bladesmith.devices import device_kind
from bladesmith.errors import quiet_log
from bladesmith.runtimes.aoti import SUFFIX as AOTI_SUFFIX
from bladesmith.runtimes.onnxruntime import SUFFIX as ONNX_SUFFIX
from bladesmith.runtimes.operator_allowlist import refused_in_exported
from bladesmith.runtimes.torchscript import in_eval_mode, load_checked
from bladesmith.trust import UntrustedFileError, require


def working_copy(model, device: torch.device, trust: bool = False) -> tuple[nn.Module, dict]:
    """A private copy of ``model`` in eval mode on ``device``, and what it is."""
    if isinstance(model, (str, os.PathLike)):
        module, kind = load_model_file(model, trust=trust), None
    elif isinstance(model, torch.export.ExportedProgram):
        module, kind = copy.deepcopy(model.module()), "torch.export program"
    elif isinstance(model, nn.Module):
        module = copy.deepcopy(model)
        kind = "TorchScript" if isinstance(model, torch.jit.ScriptModule) else "nn.Module"
    else:
        raise TypeError(
            "model: expected an nn.Module, a TorchScript module, a torch.export program or "
            f"the path of a .pt/.pt2 file, got {type(model).__name__}"
        )
    if kind is None:
        kind = (
            "TorchScript" if isinstance(module, torch.jit.ScriptModule) else "torch.export program"
        )
    was_training = getattr(module, "training", False)  # a frozen module has no flag
    in_eval_mode(module)
    tensors = [*module.parameters(), *module.buffers()]
    if any(tensor.device != device for tensor in tensors):
        module.to(device)
    info = {
        "name": getattr(module, "original_name", None)
        if isinstance(module, torch.jit.ScriptModule)
        else type(module).__name__,
        "format": kind,
        "parameters": sum(p.numel() for p in module.parameters()),
        "was_training": was_training,
    }
    return module, info


def model_dtype(module: nn.Module) -> torch.dtype:
    """The floating-point dtype ``module`` computes in: its floating-point weights' (the
    most common), float32 when it has none."""
    counts: dict[torch.dtype, int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def load_model_file(path, trust: bool = False) -> nn.Module:
    """The module in a TorchScript (.pt) or torch.export (.pt2) file, on the CPU. Any
    file that is not one raises a BladesmithError saying what the file is instead. What
    would run code the file brings (TorchScript or a torch.export graph outside the
    operator allowlist, a .pt2 that torch's pickle reader alone reads) is refused in one
    line unless ``trust`` (docs/security.md)."""
    from bladesmith.errors import BladesmithError, MissingFileError

    path = os.fspath(path)
    problem = unreadable(path)
    if problem:
        error = MissingFileError if not os.path.exists(path) else BladesmithError
        raise error(f"model {path!r}: {problem}")
    if path.endswith(ONNX_SUFFIX):
        raise BladesmithError(
            f"model {path!r}: an ONNX model, where a TorchScript (.pt) or torch.export "
            "(.pt2) file is needed (ONNX models go to bladesmith check and fix)"
        )
    with contextlib.suppress(ImportError, BladesmithError):  # models may use our ops
        from bladesmith import ops

        ops.load_library()
    if path.endswith(AOTI_SUFFIX):
        return _exported_module(path, trust)
    try:
        return load_checked(path, trust, "model", map_location="cpu")
    except UntrustedFileError:
        raise
    except Exception as error:  # torch raises RuntimeError, ValueError, pickle errors...
        from bladesmith.ops import libraries

        operator = libraries.operator_error(error, f"model {path}")
        if operator is not None:
            raise operator from None
        what = contents(path)
        why = "" if what.startswith(("a pickled", "a torch.save")) else f" ({first_line(error)})"
        raise BladesmithError(
            f"model {path!r}: not a TorchScript model but {what}{why}; save one with "
            "torch.jit.save(torch.jit.script(model) or torch.jit.trace(model, example), "
            "path), or a .pt2 with torch.export.save(torch.export.export(model, example), "
            "path), or pass the nn.Module from Python"
        ) from error


def _exported_module(path: str, trust: bool) -> nn.Module:
    """The module of the torch.export program in ``path``: read without pickle and
    checked against the operator allowlist (``runtimes.pt2_archive``,
    ``runtimes.operator_allowlist``), or, where it cannot be and ``trust``, by
    torch.export.load, which runs what its pickles and expressions hold."""
    from bladesmith.errors import BladesmithError
    from bladesmith.runtimes import pt2_archive

    is_zip = zipfile.is_zipfile(path)
    compiled = pt2_archive.aoti_models(pt2_archive.members(path)) if is_zip else []
    try:
        with quiet_log("torch.export"):
            program = pt2_archive.exported_program(path)
    except pt2_archive.Untrusted as why:
        if compiled:
            raise BladesmithError(
                f"model {path!r}: an AOTInductor package ({', '.join(compiled)}), already "
                "compiled, not a torch.export program: run it with bladesmith bench or "
                "serve (Python: bladesmith.load)"
            ) from None
        require(path, f"torch.export.load's pickles and expressions ({why})", trust, "model")
        program = _torch_export_load(path)
    except Exception as error:
        raise BladesmithError(
            f"model {path!r}: not a torch.export program: {contents(path)} ({first_line(error)})"
        ) from error
    else:
        outside = refused_in_exported(program)
        if outside is not None:
            what = f"a torch.export graph outside the operator allowlist ({outside})"
            require(path, what, trust, "model")
    return program.module()


def _torch_export_load(path: str) -> torch.export.ExportedProgram:
    from bladesmith.errors import BladesmithError

    try:
        with quiet_log("torch.export"):
            return torch.export.load(path)
    except Exception as error:
        raise BladesmithError(
            f"model {path!r}: not a torch.export program: {contents(path)} ({first_line(error)})"
        ) from error


def device_argument(device, device_type: str | None):
    """``device``, or PAI-Blade's ``device_type`` when only that was given."""
    if device_type is None:
        return device
    if device != "auto" and device_kind(device) != device_kind(device_type):
        raise ValueError(
            f"device={device!r} and device_type={device_type!r} disagree: device_type is "
            "PAI-Blade's name for device; give one of them"
        )
    return device_type


def argument_tuples(test_data) -> list[tuple]:
    if test_data is None or isinstance(test_data, (torch.Tensor, str)) or not len(test_data):
        raise ValueError(
            "test_data: expected a non-empty list of sample inputs, one entry per call: a "
            "tuple of arguments, or the single argument (an image model's: its list of images)"
        )
    return [entry if isinstance(entry, tuple) else (entry,) for entry in test_data]


def to_device(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def items_per_call(args: tuple) -> int:
    """Items per call, for throughput: a list of images, or a batch of images."""
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], torch.Tensor):
        return len(first)
    if isinstance(first, torch.Tensor) and first.dim() == 4:
        return first.shape[0]
    return 1
