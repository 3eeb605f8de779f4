"""The packed head: levels laid out apart on one canvas, outputs equal to torchvision's."""

import functools

import pytest
import torch
from torch import nn

from bladesmith.config import Config
from bladesmith.families.retinanet import FAMILY, RetinaNetPipeline, build_retinanet
from bladesmith.families.retinanet_head import PackedRetinaNetHead, pack_levels, packing_problem
from bladesmith.images import sample_images
from bladesmith.passes import Candidate, Context
from bladesmith.passes.head_packing import HeadPacking

SIZE = (64, 96)


@pytest.fixture(scope="module")
def model():
    return build_retinanet(SIZE, backbone="resnet18", num_classes=5)


@pytest.mark.parametrize(
    "shapes",
    [
        [(60, 80), (30, 40), (15, 20), (8, 10), (4, 5)],  # 480x640
        [(20, 28), (10, 14), (5, 7), (3, 4), (2, 2)],
        [(13, 7), (7, 4), (4, 2), (2, 1), (1, 1)],  # tall and narrow
        [(5, 5)],
        [(1, 1), (1, 1), (1, 1)],
    ],
)
def test_levels_lie_inside_the_canvas_and_never_touch(shapes):
    origins, (height, width) = pack_levels(shapes)
    assert len(origins) == len(shapes)
    owner = torch.full((height + 2, width + 2), -1)  # a border so neighbours never wrap
    for index, ((top, left), (h, w)) in enumerate(zip(origins, shapes)):
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
        assert (owner[top + 1 : top + h + 1, left + 1 : left + w + 1] == -1).all()
        owner[top + 1 : top + h + 1, left + 1 : left + w + 1] = index
    # A 3x3 window around any level pixel sees only that level or zeros.
    for index, ((top, left), (h, w)) in enumerate(zip(origins, shapes)):
        window = owner[top : top + h + 2, left : left + w + 2]
        assert set(window.unique().tolist()) <= {index, -1}
    assert height * width < 1.5 * sum(h * w for h, w in shapes) + 2 * width


def test_the_480x640_pyramid_wastes_little():
    shapes = [(60, 80), (30, 40), (15, 20), (8, 10), (4, 5)]
    _, (height, width) = pack_levels(shapes)
    assert (height, width) == (91, 80)  # 7,280 positions for 6,400


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_packed_head_equals_torchvision_head(model, channels_last):
    pipeline = RetinaNetPipeline(model, SIZE)
    images = sample_images(2, SIZE)
    with torch.no_grad():
        features = list(pipeline.backbone(pipeline.transform(images)).values())
        expected = model.head(features)
        if channels_last:
            features = [f.contiguous(memory_format=torch.channels_last) for f in features]
        packed = PackedRetinaNetHead(model.head, pipeline.grid_sizes)
        cls_logits, bbox_deltas = packed(features)
    torch.testing.assert_close(cls_logits, expected["cls_logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bbox_deltas, expected["bbox_regression"], rtol=1e-5, atol=1e-5)


def test_pipeline_with_packed_head_keeps_its_detections_and_traces(model):
    pipeline = RetinaNetPipeline(model, SIZE)
    images = sample_images(2, SIZE)
    with torch.no_grad():
        expected = pipeline(images)
        pipeline.pack_head()
        found = pipeline(images)
        traced = torch.jit.trace(pipeline, (images,), check_trace=False)(images)
    for a, b, c in zip(expected, found, traced):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-4)


def test_heads_with_normalisation_are_refused():
    from torchvision.models.detection.retinanet import RetinaNetHead

    head = RetinaNetHead(32, 9, 5, norm_layer=functools.partial(nn.GroupNorm, 8))
    assert "normalisation" in packing_problem(head)
    with pytest.raises(ValueError, match="cannot pack"):
        PackedRetinaNetHead(head, [(4, 4)])


def test_pass_packs_a_copy_and_says_when_it_does_not_apply(model):
    images = sample_images(1, SIZE)
    context = Context(torch.device("cpu"), "o1", Config(), (images,), [(images,)])
    pipeline = RetinaNetPipeline(model, SIZE)
    packing = HeadPacking()
    assert "fixed_shape" in packing.skip_reason(Candidate(model, context.device), context)
    candidate = Candidate(pipeline, context.device, family=FAMILY)
    assert packing.skip_reason(candidate, context) is None
    packed = packing.apply(candidate, context)
    assert not isinstance(pipeline.head, PackedRetinaNetHead)
    assert isinstance(packed.module.head, PackedRetinaNetHead)
    assert packed.applied == ("head_packing",)
    assert packing.skip_reason(packed, context) == "the head is already packed"
