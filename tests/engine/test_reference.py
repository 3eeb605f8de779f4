"""engine.reference: the model as given under rounding noise."""

from __future__ import annotations

import torch

from bladesmith.engine.reference import reference_under_noise


def test_reference_under_noise_moves_outputs_by_rounding_only_and_repeats():
    model = torch.nn.Linear(64, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = [(torch.randn(4, 64),)]
    first = reference_under_noise(model, inputs, runs=2)
    again = reference_under_noise(model, inputs, runs=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    exact = model(*inputs[0])
    for run, repeated in zip(first, again, strict=True):
        assert torch.equal(run[0], repeated[0])
        change = (run[0] - exact).abs().max() / exact.abs().max()
        assert 0 < change < 5e-3
    assert not torch.equal(first[0][0], first[1][0])
