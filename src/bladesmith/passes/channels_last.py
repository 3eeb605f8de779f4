"""channels_last: 4-D weights in NHWC order, the layout cuDNN's and oneDNN's fastest
convolution kernels (tensor cores on the GPU) read directly."""

from __future__ import annotations

import copy

import torch
from torch import nn

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class ChannelsLast(Pass):
    """Convolution weights in channels_last (NHWC) memory format."""

    name = "channels_last"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if isinstance(candidate.module, torch.jit.ScriptModule):
            return "TorchScript modules keep their memory format; give optimize the nn.Module"
        if not any(isinstance(m, nn.Conv2d) for m in candidate.module.modules()):
            return "the model has no 2-D convolutions"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module).to(memory_format=torch.channels_last)
        return candidate.with_module(module, self.name)
