"""TorchScript: a module traced and frozen, the runner that the torchscript pass builds
and that ``.pt`` artifacts hold (bladesmith's metadata in the file's extra files).

TorchScript is deprecated from torch 2.10 on (the FutureWarnings are silenced here on
purpose: it is still the fastest Python-free form on small CPUs).
"""

from __future__ import annotations

import contextlib
import json
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from bladesmith.errors import BladesmithError
from bladesmith.runtimes.built_for import BuiltFor, Checked, follows_the_batch
from bladesmith.runtimes.format import Format
from bladesmith.runtimes.operator_allowlist import refused_in_script_module
from bladesmith.trust import require
from bladesmith.verify.detections import contains_detections

SUFFIX = ".pt"


def write(module, calls: list[tuple], path: Path, metadata: dict, *, key: str, **_) -> None:
    """``module`` frozen on the first of ``calls``, with the metadata (as ``key``.json)
    and what the trace runs (``traced_inputs``)."""
    frozen = freeze(module, calls[0])
    metadata["inputs"] = traced_inputs(frozen, module, calls[0])
    extra = {f"{key}.json": json.dumps(metadata)}
    with quiet_torchscript():
        torch.jit.save(frozen, str(path), _extra_files=extra)


def metadata(path: Path, key: str) -> str | None:
    """bladesmith's metadata (``key``.json), read from the archive without loading the
    module (which fails while the operators it calls are not loaded)."""
    with zipfile.ZipFile(path) as archive:
        name = next((n for n in archive.namelist() if n.endswith(f"/extra/{key}.json")), None)
        return archive.read(name).decode() if name is not None else None


def read(path: Path, info: dict, trust: bool = False) -> torch.jit.ScriptModule:
    return load_checked(path, trust)


def load_checked(
    path: str | Path, trust: bool, source: str = "load", **options
) -> torch.jit.ScriptModule:
    """``torch.jit.load(path, **options)`` where what it runs is inside the operator
    allowlist (``operator_allowlist``), else only when ``trust`` (``trust.require``).
    torch.jit.load runs a class's ``__setstate__`` as it reads the file: a file whose
    code defines one is refused before it is read; the rest is checked after reading,
    before anything is called."""
    on_load = code_run_on_load(path)
    if on_load is not None:
        require(path, on_load, trust, source)
    with quiet_torchscript():
        module = torch.jit.load(str(path), **options)
    if on_load is None:
        outside = refused_in_script_module(module)
        if outside is not None:
            what = f"TorchScript outside the operator allowlist ({outside})"
            require(path, what, trust, source)
    return module


def code_run_on_load(path: str | Path) -> str | None:
    """What TorchScript code ``torch.jit.load`` would run reading ``path`` (a
    ``__setstate__``, in any of its code records, as torch's own reader lists them), or
    None. Files it cannot read are left to torch.jit.load's own error."""
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = reader.get_all_records()
    except Exception:  # not an archive: torch.jit.load says what it is
        return None
    for name in records:
        if name.endswith(".py") and b"__setstate__" in reader.get_record(name):
            return f"the TorchScript __setstate__ in {name}, as it loads"
    return None


def guarded(candidate, spec, example_args: tuple | None):
    """What an optimized module runs for the engine's ``candidate``, and the ``BuiltFor``
    it checks each call against (or None): a family's pipeline or a trace that keeps its
    example's batch refuses inputs it was not built for, as its saved file does."""
    # The model as given (nothing applied) runs as its own forward, through nothing.
    untouched = not candidate.applied and candidate.runner is None
    run = candidate.module if untouched else candidate
    built_for, source = None, "images"
    if candidate.family is not None and spec is not None:
        # Its trace or graph has no size check (Python's is not traced): images of
        # another size or dtype would be resized and normalised as if of its own.
        why = "its fixed-shape pipeline was built for images of this size"
        built_for = BuiltFor.of(spec, free_batch=True, why=why)
    elif (
        spec is not None
        and isinstance(candidate.runner, nn.Module)
        and is_torchscript(candidate.runner)
    ):
        # A trace that keeps its example's batch answers others wrongly: refused as
        # its .pt is. One that follows the batch is left free: it was verified on
        # every size of the test data, which its .pt (checked at one) is not.
        inputs = traced_inputs(candidate.runner, candidate.module, example_args)
        if not inputs["free_batch"]:
            built_for, source = BuiltFor.of(spec, **inputs), "optimized module"
    return (Checked({built_for: run}, source) if built_for is not None else run), built_for


def traced_inputs(trace, module, args: tuple) -> dict:
    """What a trace of ``module`` on ``args`` runs, as ``BuiltFor.of``'s keywords: whether
    its batch is free (``follows_the_batch``), and why others are refused."""
    free = follows_the_batch(trace, module, args)
    why = "traced at these sizes" + (
        ", and checked at other batches" if free else "; at another batch it answers otherwise"
    )
    # One that keeps its batch holds only that: optimize verified it, and save checks
    # it, at every size of the test data, which the spec (the first) does not list.
    return {"free_batch": free, "why": why, "batch_only": not free}


@contextmanager
def quiet_torchscript():
    """Silence TorchScript's deprecation and tracer warnings (we chose it on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


def in_eval_mode(module: nn.Module) -> nn.Module:
    """``module`` in eval mode. A torch.export program's module refuses ``eval()``: its
    graph already holds the mode it was exported in."""
    with contextlib.suppress(NotImplementedError):
        module.eval()
    return module


def is_torchscript(module: nn.Module) -> bool:
    """Whether ``module`` is TorchScript, or wraps a TorchScript module (the precision
    passes wrap the model in a cast)."""
    return any(isinstance(each, torch.jit.ScriptModule) for each in module.modules())


def freeze(module: nn.Module, example_args: tuple) -> torch.jit.ScriptModule:
    """``module`` traced on ``example_args`` (kept as is when already TorchScript),
    then frozen. Tracing records the path these inputs take: fine for the fixed-shape
    models bladesmith produces, which have no data-dependent control flow.

    Outputs that hold a dict (torchvision's segmentation models, ``{"out": ...}``) are
    traced with ``strict=False``, which the tracer needs to return them: their structure
    is the model's code, not the data's. Other outputs are traced strictly, so that a list
    whose length could follow the data is still refused; so is a detector's per-image
    list of detection dicts (what they hold follows the data)."""
    with quiet_torchscript(), torch.no_grad():
        if isinstance(module, torch.jit.ScriptModule):
            scripted = module
        else:
            outputs = in_eval_mode(module)(*example_args)
            strict = contains_detections(outputs) or not _holds_dict(outputs)
            try:
                scripted = torch.jit.trace(module, example_args, check_trace=False, strict=strict)
            except RuntimeError as error:  # its message prints every output tensor's values
                if "Tracer cannot infer type of" not in str(error):
                    raise
                raise BladesmithError(
                    f"TorchScript cannot hold the model's outputs, {structure(outputs)}: "
                    "the items of a list, and the values of a dict, must all be of one type"
                ) from error
            _check_inputs_traced(scripted, example_args)
        frozen = torch.jit.freeze(scripted.eval())
    host_scalar_constants(frozen.graph)
    return frozen


def _check_inputs_traced(traced: torch.jit.ScriptModule, example_args: tuple) -> None:
    """Refuse a trace that computes nothing from its inputs: the tracer records a Python
    list or dict handed to a TorchScript module inside the trace (a list of dicts of
    images, say) as a constant, and the traced model would then answer every call with
    the example's outputs."""
    inputs = list(traced.graph.inputs())[1:]  # after self
    carrying = [
        value
        for value, arg in zip(inputs, example_args)
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(arg))
    ]
    if carrying and not any(value.uses() for value in carrying):
        shown = ", ".join(structure(arg) for arg in example_args)
        raise BladesmithError(
            f"TorchScript's trace held the inputs ({shown}) as constants: a list or dict "
            "handed to a TorchScript module inside a trace is recorded as a value, so the "
            "traced model would answer every input as it answered the test data; keep the "
            "TorchScript model as it is (no wrapper), or give it tensors"
        )


def structure(value) -> str:
    """``value``'s structure in a few words, its tensors as ``Tensor``: for messages that
    must not print the values (``{'out': Tensor, 'aux': [Tensor, {'n': Tensor}]}``)."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {structure(each)}" for key, each in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(structure, value)) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(structure, value)) + ("," if len(value) == 1 else "") + ")"
    return type(value).__name__


def _holds_dict(value) -> bool:
    if isinstance(value, dict):
        return True
    return isinstance(value, (list, tuple)) and any(_holds_dict(each) for each in value)


# Operators that read a tensor's value on the host: on a GPU tensor, a synchronisation.
_HOST_READS = frozenset(
    {"aten::Int", "aten::Float", "aten::Bool", "aten::ScalarImplicit", "aten::item"}
)
_HOPS = 8  # how far a constant's uses are followed to a host read


def host_scalar_constants(graph: torch._C.Graph) -> int:
    """Integer scalar constants that the host reads, moved back to the CPU; returns how
    many. A trace turns shape arithmetic (``(x.shape[1] + 1) // 2``) into operations on
    scalar tensors, CPU ones; ``torch.jit.load(..., map_location="cuda")`` moves every
    constant to the GPU, and then each ``int()`` of such a result waits for the GPU: no
    CUDA graph can be captured. On the CPU they are scalars again (a CPU scalar combines
    with GPU tensors), and the arithmetic never leaves the host."""
    moved = host_read_constants(graph)
    for node in moved:
        with graph.insert_point_guard(node):
            host = graph.insertConstant(node.t("value").cpu())
        node.output().replaceAllUsesWith(host)
        node.destroy()
    return len(moved)


def host_read_constants(graph: torch._C.Graph) -> list[torch._C.Node]:
    """The integer scalar constants off the CPU whose values the host reads."""
    found = []
    for node in graph.findAllNodes("prim::Constant"):
        if not node.hasAttribute("value") or node.kindOf("value") != "t":
            continue
        value = node.t("value")
        if value.dim() != 0 or value.device.type == "cpu" or value.is_floating_point():
            continue
        if _read_on_host(node.output()):
            found.append(node)
    return found


def _read_on_host(value: torch._C.Value, hops: int = _HOPS) -> bool:
    for use in value.uses():
        user = use.user
        if user.kind() in _HOST_READS:
            return True
        if hops > 1 and any(_read_on_host(output, hops - 1) for output in user.outputs()):
            return True
    return False


class TorchScript(Format):
    suffix = SUFFIX
    description = "frozen TorchScript (torch.jit.trace + freeze)"
    devices = ("cuda", "cpu", "mps")
    build_cost = "seconds"
    zip_archive = True
    needs_fake_kernels = False
    triton_backend = "pytorch_libtorch"

    def refuses(self, module, device) -> str | None:
        return None  # a trace runs wherever torch does

    write = staticmethod(write)
    metadata = staticmethod(metadata)
    read = staticmethod(read)


FORMAT = TorchScript()
