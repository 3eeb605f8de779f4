"""torchscript: trace, freeze and optimize for inference (CPU; and a TorchScript
model's own route on the GPU).

Freezing inlines the parameters as constants, which lets TorchScript fold
convolution + batch norm, drop dropout, and pre-pack weights for oneDNN. A model given
as TorchScript is frozen as it is (after the precision and memory-format passes, which
change its parameters): on the GPU too, where Inductor, which cannot read TorchScript,
compiles the nn.Modules instead. TorchScript is deprecated from torch 2.10 on (the
FutureWarnings are silenced here on purpose: it is still the fastest Python-free form on
small CPUs, and the form PAI-Blade's users bring their models in).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, register


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
        return torch.jit.freeze(scripted.eval())


@register
class TorchScriptFreeze(Pass):
    """TorchScript trace + freeze + optimize_for_inference (CPU)."""

    name = "torchscript"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if context.device.type != "cpu" and not is_torchscript(candidate.module):
            return "on the GPU, Inductor compiles nn.Modules; this is for TorchScript models"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        example = candidate.runner_args(context.example_args)
        with context.step("tracing and freezing with TorchScript"):
            frozen = freeze(candidate.module, example)
            with quiet_torchscript():
                optimized = torch.jit.optimize_for_inference(frozen)
                with torch.no_grad():
                    optimized(*example)  # the profiling executor specialises on first runs
        return candidate.with_runner(optimized, self.name)
