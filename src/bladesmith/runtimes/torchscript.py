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
        return torch.jit.freeze(scripted.eval())
