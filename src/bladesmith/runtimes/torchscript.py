"""TorchScript: a module traced and frozen, the runner that the torchscript pass builds
and that ``.pt`` artifacts hold.

TorchScript is deprecated from torch 2.10 on (the FutureWarnings are silenced here on
purpose: it is still the fastest Python-free form on small CPUs).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def quiet_torchscript():
    """Silence TorchScript's deprecation and tracer warnings (we chose it on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


def is_torchscript(module: nn.Module) -> bool:
    """Whether ``module`` is TorchScript, or wraps a TorchScript module (the precision
    passes wrap the model in a cast)."""
    return any(isinstance(each, torch.jit.ScriptModule) for each in module.modules())


def freeze(module: nn.Module, example_args: tuple) -> torch.jit.ScriptModule:
    """``module`` traced on ``example_args`` (kept as is when already TorchScript),
    then frozen. Tracing records the path these inputs take: fine for the fixed-shape
    models bladesmith produces, which have no data-dependent control flow."""
    with quiet_torchscript(), torch.no_grad():
        scripted = (
            module
            if isinstance(module, torch.jit.ScriptModule)
            else torch.jit.trace(module.eval(), example_args, check_trace=False)
        )
        frozen = torch.jit.freeze(scripted.eval())
    host_scalar_constants(frozen.graph)
    return frozen


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
