"""channels_last: 4-D weights in NHWC order, the layout cuDNN's and oneDNN's fastest
convolution kernels (tensor cores on the GPU) read directly. A convolution given a
channels_last weight returns channels_last, so the layout carries through the model
from the first convolution on; TorchScript models' weights convert the same way."""

from __future__ import annotations

import copy

import torch

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class ChannelsLast(Pass):
    """Convolution weights in channels_last (NHWC) memory format."""

    name = "channels_last"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if not any(p.dim() == 4 for p in candidate.module.parameters()):
            return "the model has no 2-D convolutions (no 4-D weights)"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module).to(memory_format=torch.channels_last)
        return candidate.with_module(module, self.name)
