"""multilevel_roi_align against torchvision's MultiScaleRoIAlign: each box pooled from its
own level, on ordinary and adversarial boxes (outside the image, empty, at the edges), by
the operator's CPU and CUDA kernels and by its ONNX lowering in ONNX Runtime."""

import pytest
import torch
from torchvision.ops import MultiScaleRoIAlign

from bladesmith import ops
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


def operator_args(channels: int, dtype=torch.float32, device="cpu"):
    """The operator's own arguments for two images' boxes on four levels."""
    maps = features(2, channels, dtype, device)
    rois = boxes(2, 200)
    pooler = MultiScaleRoIAlign(NAMES, 7, 2)
    pooler(features(2, 1), rois, [IMAGE] * 2)  # its scales and level mapper
    flat = torch.cat([torch.cat([torch.full((200, 1), i), b], 1) for i, b in enumerate(rois)])
    table = torch.cat([maps[n].permute(0, 2, 3, 1).reshape(2, -1, channels) for n in NAMES], 1)
    sizes = [tuple(maps[n].shape[-2:]) for n in NAMES]
    return (
        table.reshape(-1, channels),
        flat.to(device),
        pooler.map_levels(rois).to(device),
        [h for h, _ in sizes],
        [w for _, w in sizes],
        pooler.scales,
        7,
        7,
        2,
    )


def test_the_operator_passes_opcheck():
    torch.library.opcheck(ops._ops().multilevel_roi_align.default, operator_args(4))


def test_a_box_that_names_no_image_or_level_of_the_table_pools_to_zero():
    args = list(operator_args(4))
    args[1] = args[1].clone()
    args[1][:3, 0] = torch.tensor([2.0, -1.0, float("nan")])  # the table holds images 0 and 1
    args[2] = args[2].clone()
    args[2][3:5] = torch.tensor([-1, 4])  # and levels 0 to 3
    pooled = ops._ops().multilevel_roi_align(*args)
    assert torch.equal(pooled[:5], torch.zeros_like(pooled[:5]))
    assert pooled[5:].abs().sum() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__(0, a[0][:-1]), "table: expected rows in whole images"),
        (lambda a: a.__setitem__(4, a[4][:-1]), "widths, scales: expected one per level"),
        (lambda a: a.__setitem__(2, a[2].int()), "level_of: expected dtype int64"),
        (lambda a: a.__setitem__(8, 0), "sampling_ratio: expected a positive ratio"),
        (lambda a: a.__setitem__(slice(3, 5), [[2**32] * 4] * 2), "pixels overflow int64"),
        (lambda a: a.__setitem__(3, [0, 1, 1, 1]), "heights, widths: expected positive"),
        (lambda a: a.__setitem__(3, [1] * 17), "expected 1 to 16 levels"),
    ],
)
def test_the_kernel_and_the_fake_kernel_refuse_alike(change, message):
    args = list(operator_args(4))
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        ops._ops().multilevel_roi_align(*args)
    from bladesmith.ops.fake import multilevel_roi_align_fake

    with pytest.raises((ValueError, TypeError), match=message):
        multilevel_roi_align_fake(*args)


# Channels that fill the CUDA kernel's 16-byte loads (8 half or 4 float), and 6, which
# leaves it one channel per thread.
@cuda
@pytest.mark.parametrize("channels", [8, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_cuda_kernel_gives_the_cpu_kernels_floats(channels, dtype):
    on_cpu = operator_args(channels, dtype)
    on_gpu = operator_args(channels, dtype, "cuda")
    expected = ops._ops().multilevel_roi_align(*on_cpu)
    found = ops._ops().multilevel_roi_align(*on_gpu)
    assert found.dtype == dtype and found.shape == expected.shape
    torch.testing.assert_close(found.cpu(), expected, rtol=0, atol=0)


@cuda
def test_the_cuda_kernel_replays_in_a_cuda_graph():
    args = operator_args(8, torch.float16, "cuda")
    expected = ops._ops().multilevel_roi_align(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        found = ops._ops().multilevel_roi_align(*args)
    graph.replay()
    torch.testing.assert_close(found, expected, rtol=0, atol=0)


class Pooling(torch.nn.Module):
    """The operator as a saved .pt or .pt2 holds it: called on its own arguments."""

    def __init__(self, args):
        super().__init__()
        self.lists = args[3:]

    def forward(self, table, rois, level_of):
        return ops._ops().multilevel_roi_align(table, rois, level_of, *self.lists)


@pytest.mark.parametrize("custom_ops", ["domain", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_saved_trace_of_the_operator_exports_to_onnx_with_its_floats(custom_ops, dtype, tmp_path):
    import onnxruntime

    from bladesmith.onnx import export

    args = operator_args(8, dtype)
    inputs = args[:3]
    trace = torch.jit.trace(Pooling(args), inputs)
    path = export(trace, inputs, tmp_path / "pool.onnx", custom_ops=custom_ops)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)}
    (found,) = session.run(None, feed)
    torch.testing.assert_close(torch.from_numpy(found), trace(*inputs), rtol=0, atol=0)
