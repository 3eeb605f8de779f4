"""torchscript: trace, freeze and optimize for inference (CPU).

Freezing inlines the parameters as constants, which lets TorchScript fold
convolution + batch norm, drop dropout, and pre-pack weights for oneDNN
(``runtimes.torchscript``).
"""

from __future__ import annotations

import torch

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes.torchscript import freeze, quiet_torchscript
from bladesmith.spec import TORCHSCRIPT_SUFFIX


class TorchScriptFreeze(Pass):
    """TorchScript trace + freeze + optimize_for_inference (CPU)."""

    name = "torchscript"
    devices = ("cpu",)
    saves_as = TORCHSCRIPT_SUFFIX

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        example = candidate.runner_args(context.example_args)
        with context.step("tracing and freezing with TorchScript"):
            frozen = freeze(candidate.module, example)
            with quiet_torchscript():
                optimized = torch.jit.optimize_for_inference(frozen)
                with torch.no_grad():
                    optimized(*example)  # the profiling executor specialises on first runs
        return candidate.with_runner(optimized, self.name)
