"""multilevel_roi_align against torchvision's MultiScaleRoIAlign: each box pooled from its
own level, on ordinary and adversarial boxes (outside the image, empty, at the edges)."""

import pytest
import torch
from torchvision.ops import MultiScaleRoIAlign

from bladesmith.families.multilevel_roi_align import multilevel_roi_align
from engine_testing import cuda

IMAGE = (640, 800)  # large enough that boxes reach every level
NAMES = ["0", "1", "2", "3"]


def features(batch: int, channels: int, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(batch, channels, IMAGE[0] >> (2 + i), IMAGE[1] >> (2 + i),
                          generator=generator).to(device, dtype)
        for i, name in enumerate(NAMES)
    }  # fmt: skip


def boxes(batch: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    height, width = IMAGE
    found = []
    for _ in range(batch):
        corner = torch.rand(count, 2, generator=generator) * torch.tensor([width, height])
        extent = torch.rand(count, 2, generator=generator) ** 2 * torch.tensor([width, height])
        box = torch.cat([corner, corner + extent], 1)
        box[:8] = torch.tensor(
            [
                [-40.0, -30.0, -10.0, -5.0],  # wholly outside: samples read 0
                [width - 1.0, height - 1.0, width + 30.0, height + 20.0],  # past the edge
                [50.0, 40.0, 50.0, 40.0],  # empty: one pixel wide
                [0.0, 0.0, width, height],  # the whole image
                [-3.0, -3.0, 20.0, 20.0],  # partly outside
                [10.25, 10.75, 10.5, 11.0],  # smaller than a pixel
                [0.0, 0.0, 4.0, 4.0],
                [width - 4.0, height - 4.0, width, height],
            ]
        )
        found.append(box)
    return found


def pooled_both(batch: int, count: int, output: int, ratio: int, dtype=torch.float32, device="cpu"):
    maps = features(batch, 8, dtype, device)
    rois = [b.to(device) for b in boxes(batch, count)]
    pooler = MultiScaleRoIAlign(NAMES, output, ratio)
    reference = pooler(maps, rois, [IMAGE] * batch)  # sets its scales and level mapper
    flat = torch.cat(
        [torch.cat([torch.full((len(b), 1), i, dtype=b.dtype, device=device), b], 1)
         for i, b in enumerate(rois)]
    )  # fmt: skip
    level_of = pooler.map_levels(rois)
    ours = multilevel_roi_align(
        [maps[n] for n in NAMES], flat.to(dtype), level_of, pooler.scales, (output, output), ratio
    )
    return reference, ours, level_of


@pytest.mark.parametrize("output, ratio", [(7, 2), (14, 2), (7, 1), (5, 3)])
def test_equals_torchvision_on_every_level(output, ratio):
    reference, ours, level_of = pooled_both(2, 300, output, ratio)
    assert set(level_of.tolist()) == {0, 1, 2, 3}  # every level has boxes
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)  # torchvision's arithmetic


def test_channels_last_features_give_the_same():
    maps = features(1, 16)
    rois = boxes(1, 50)
    pooler = MultiScaleRoIAlign(NAMES, 7, 2)
    reference = pooler(maps, rois, [IMAGE])
    flat = torch.cat([torch.zeros(50, 1), rois[0]], 1)
    last = [maps[n].contiguous(memory_format=torch.channels_last) for n in NAMES]
    ours = multilevel_roi_align(last, flat, pooler.map_levels(rois), pooler.scales, (7, 7), 2)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)  # torchvision's arithmetic


def test_an_adaptive_sampling_ratio_is_refused():
    with pytest.raises(ValueError, match="sampling_ratio"):
        multilevel_roi_align([torch.zeros(1, 1, 4, 4)], torch.zeros(1, 5), torch.zeros(1).long(),
                             [1.0], (2, 2), 0)  # fmt: skip


@cuda
def test_float16_on_the_gpu_is_within_half_precision_of_float32():
    reference, _, _ = pooled_both(2, 1000, 7, 2)
    maps = features(2, 8, torch.float16, "cuda")
    rois = boxes(2, 1000)
    pooler = MultiScaleRoIAlign(NAMES, 7, 2)
    pooler(features(2, 8), rois, [IMAGE] * 2)  # its scales and level mapper, on the CPU
    flat = torch.cat([torch.cat([torch.full((1000, 1), i), b], 1) for i, b in enumerate(rois)])
    ours = multilevel_roi_align(
        [maps[n] for n in NAMES],
        flat.cuda(),  # boxes stay float32, as the pipelines pass them
        pooler.map_levels(rois).cuda(),
        pooler.scales,
        (7, 7),
        2,
    )
    assert ours.dtype == torch.float16
    torch.testing.assert_close(ours.float().cpu(), reference, rtol=1e-2, atol=1e-2)
