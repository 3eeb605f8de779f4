"""bladesmith::roi_align_nhwc against torchvision's roi_align: the same floats."""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import roi_align as torchvision_roi_align

import bladesmith
from bladesmith.ops import roi_align


@pytest.fixture(scope="module", autouse=True)
def library():
    bladesmith.ops.load_library()


def random_rois(count: int, images: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Boxes of every kind: inside, across and outside the map, tiny, reversed."""
    generator = torch.Generator().manual_seed(seed)
    corner = torch.rand(count, 2, generator=generator) * torch.tensor([width, height]) * 1.4
    corner -= torch.tensor([width, height]) * 0.2
    size = torch.rand(count, 2, generator=generator) * torch.tensor([width, height]) * 0.6
    size[: count // 10] *= -0.05  # a few reversed (x2 < x1)
    index = torch.randint(0, images, (count, 1), generator=generator).float()
    return torch.cat([index, corner, corner + size], dim=1)


@pytest.mark.parametrize("channels", [1, 37, 256])
@pytest.mark.parametrize("sampling_ratio", [2, 0, -1])
@pytest.mark.parametrize("aligned", [False, True])
def test_equals_torchvision_to_the_bit(channels, sampling_ratio, aligned):
    features = torch.randn(2, channels, 13, 19, generator=torch.Generator().manual_seed(0))
    rois = random_rois(300, 2, 13 * 8, 19 * 8, seed=channels)
    want = torchvision_roi_align(features, rois, (7, 5), 0.125, sampling_ratio, aligned)
    got = roi_align(features, rois, (7, 5), 0.125, sampling_ratio, aligned)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)


def test_reversed_boxes_after_others_pool_as_torchvision_does():
    # Aligned, a box reversed by more than a bin has a negative sampling grid.
    features = torch.randn(1, 40, 16, 16)
    rois = torch.tensor([[0, 1, 1, 15, 15], [0, 15, 15, 1, 1.0]])
    for sampling_ratio in (0, -1, 2):
        want = torchvision_roi_align(features, rois, (2, 2), 1.0, sampling_ratio, True)
        got = roi_align(features, rois, (2, 2), 1.0, sampling_ratio, True)
        assert torch.equal(got, want)
    # Reversed one way only, the grid's size is negative: torchvision 0.29.1 refuses it
    # ("cannot create std::vector larger than max_size()"); here it pools nothing.
    rois = torch.tensor([[0, 1, 1, 15, 15], [0, 2, 14, 9, 3.0]])
    got = roi_align(features, rois, (2, 2), 1.0, 0, True)
    assert torch.equal(got[0], torchvision_roi_align(features, rois[:1], (2, 2), 1.0, 0, True)[0])
    assert not got[1].any()


def test_nan_and_infinite_boxes_pool_nothing():
    # torchvision 0.29.1's CPU kernel reads out of bounds on such boxes (a segmentation
    # fault here); its later versions take NaN samples as empty, as this kernel does.
    features = torch.randn(1, 8, 6, 6)
    rois = torch.tensor([[0, float("nan"), 1, 3, 3], [0, 1, 1, float("inf"), 2]])
    assert torch.equal(roi_align(features, rois, (2, 2), 1.0, 2), torch.zeros(2, 8, 2, 2))


def test_no_boxes_and_channels_last_input():
    features = torch.randn(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    assert roi_align(features, torch.zeros(0, 5), (7, 7), 0.5, 2).shape == (0, 16, 7, 7)
    rois = random_rois(50, 2, 18, 18, seed=3)
    want = torchvision_roi_align(features.contiguous(), rois, (7, 7), 0.5, 2)
    assert torch.equal(roi_align(features, rois, (7, 7), 0.5, 2), want)


def test_other_dtypes_take_torchvisions_operator_and_bad_boxes_are_refused():
    features = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    rois = random_rois(20, 1, 8, 8, seed=4).double()
    torch.testing.assert_close(
        roi_align(features, rois, (3, 3), 1.0, 2),
        torchvision_roi_align(features, rois, (3, 3), 1.0, 2),
    )
    with pytest.raises(RuntimeError, match="box 0 names image 3 of 1"):
        torch.ops.bladesmith.roi_align_nhwc(
            torch.randn(1, 4, 8, 8), torch.tensor([[3.0, 0, 0, 2, 2]]), 1.0, 2, 2, 2, False
        )
    with pytest.raises(RuntimeError, match=r"rois must be \[K, 5\]"):
        torch.ops.bladesmith.roi_align_nhwc(
            torch.randn(1, 4, 8, 8), torch.zeros(3, 4), 1.0, 2, 2, 2, False
        )


def test_bfloat16_features_are_pooled_in_float32_where_torchvision_has_no_kernel():
    features = torch.randn(2, 8, 12, 12).bfloat16()
    rois = random_rois(30, 2, 12, 12, seed=5)
    with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):
        torchvision_roi_align(features, rois.bfloat16(), (5, 5), 1.0, 2)
    pooled = roi_align(features, rois.bfloat16(), (5, 5), 1.0, 2)
    want = torchvision_roi_align(features.float(), rois.bfloat16().float(), (5, 5), 1.0, 2)
    assert pooled.dtype == torch.bfloat16 and torch.equal(pooled, want.bfloat16())
