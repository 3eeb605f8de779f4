"""channels_last: a converted copy; models without convolutions skipped."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.passes import Candidate
from bladesmith.passes.channels_last import ChannelsLast
from engine_testing import (
    context_for,
    conv_net,
)


def test_channels_last_converts_a_copy_and_skips_models_without_convolutions():
    model = conv_net()
    candidate = Candidate(module=model, device=torch.device("cpu"))
    converted = ChannelsLast().apply(candidate, context_for(()))
    assert converted.module[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model[0].weight.is_contiguous()
    linear = Candidate(module=nn.Linear(2, 2), device=torch.device("cpu"))
    assert "no 2-D convolutions" in ChannelsLast().skip_reason(linear, context_for(()))
