"""fixed_shape: skips models no family knows, and mixed image sizes."""

from __future__ import annotations

import pytest
import torch

import bladesmith
from bladesmith.passes import Candidate
from bladesmith.passes.fixed_shape import FixedShape
from engine_testing import (
    context_for,
    conv_net,
)


def test_fixed_shape_skips_other_models_and_mixed_sizes(retinanet):
    adapter = FixedShape()
    plain = Candidate(module=conv_net(), device=torch.device("cpu"))
    assert "no family of bladesmith.families recognises" in adapter.skip_reason(
        plain, context_for(())
    )
    mixed = [([torch.rand(3, 128, 160)],), ([torch.rand(3, 96, 128)],)]
    context = context_for(mixed[0])
    context.test_args = mixed
    candidate = Candidate(module=retinanet, device=torch.device("cpu"))
    with pytest.raises(bladesmith.passes.PassSkipped, match="several sizes"):
        adapter.apply(candidate, context)
