"""The shared steps of the fixed-shape pipelines, against torchvision's own."""

from __future__ import annotations

import pytest
import torch
from torchvision.models.detection._utils import BoxCoder

from bladesmith.families import detection_steps as steps


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_single_equals_torchvisions_to_the_bit(weights, dtype):
    generator = torch.Generator().manual_seed(0)
    coder = BoxCoder(weights)
    corner = torch.rand(500, 2, generator=generator) * 600
    boxes = torch.cat([corner, corner + torch.rand(500, 2, generator=generator) * 200], 1)
    codes = torch.randn(500, 4 * 3, generator=generator) * 3  # some past the exp clip
    codes[:20] *= 40
    codes, boxes = codes.to(dtype), boxes.to(dtype)
    want = coder.decode_single(codes, boxes)
    got = steps.decode_single(coder, codes, boxes)
    assert got.dtype == want.dtype and torch.equal(got, want)
    shaped = steps.decode_boxes(coder, codes[:, :4].reshape(5, 100, 4), boxes.reshape(5, 100, 4))
    assert torch.equal(shaped.reshape(-1, 4), coder.decode_single(codes[:, :4], boxes))
