import pytest
import torch

from bladesmith.families.base import DetectionsAsList
from bladesmith.families.retinanet import RetinaNetPipeline, build_retinanet
from bladesmith.images import sample_images
from bladesmith.verify import compare_detections

SIZE = (64, 96)


@pytest.fixture(scope="module")
def model():
    return build_retinanet(SIZE, backbone="resnet18", num_classes=5)


def test_build_is_deterministic_and_keeps_size(model):
    again = build_retinanet(SIZE, backbone="resnet18", num_classes=5)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    pipeline = RetinaNetPipeline(model, SIZE)
    assert pipeline.transform.resized_size == SIZE and pipeline.transform.padded_size == SIZE


def test_realistic_load_fills_every_level(model):
    pipeline = RetinaNetPipeline(model, SIZE)
    counts = pipeline.candidates_per_level(sample_images(2, SIZE))
    for count, level_size in zip(counts, pipeline.level_sizes):
        assert count >= min(1200, level_size * 5)


def test_random_weights_without_calibration_pass_nothing():
    plain = build_retinanet(SIZE, backbone="resnet18", num_classes=5, realistic_load=False)
    counts = RetinaNetPipeline(plain, SIZE).candidates_per_level(sample_images(1, SIZE))
    assert counts == [0] * 5


def test_static_anchors_and_head_equal_torchvision(model):
    pipeline = RetinaNetPipeline(model, SIZE)
    images = sample_images(2, SIZE)
    with torch.no_grad():
        image_list, _ = model.transform(list(images))
        features = list(model.backbone(image_list.tensors).values())
        head = model.head(features)
        anchors = model.anchor_generator(image_list, features)[0]
        cls_logits, bbox_deltas = pipeline.head_outputs(images)
    assert torch.equal(pipeline.anchors, anchors)
    assert torch.equal(cls_logits, head["cls_logits"])
    assert torch.equal(bbox_deltas, head["bbox_regression"])
    assert sum(pipeline.level_sizes) == anchors.shape[0]
    with torch.no_grad():
        cls_logits, bbox_deltas = pipeline.head_outputs(images, torch.float64)
    assert cls_logits.dtype == bbox_deltas.dtype == torch.float64
    assert torch.equal(cls_logits, head["cls_logits"].double())
    assert torch.equal(bbox_deltas, head["bbox_regression"].double())


def test_a_head_with_its_own_forward_is_called_as_is(model):
    from torchvision.models.detection.retinanet import RetinaNetClassificationHead

    class ShiftedHead(RetinaNetClassificationHead):
        def forward(self, x):
            return super().forward(x) + 1.0

    pipeline = RetinaNetPipeline(model, SIZE)
    images = sample_images(1, SIZE)
    with torch.no_grad():
        plain, _ = pipeline.head_outputs(images)
        pipeline.head.classification_head.__class__ = ShiftedHead
        try:
            shifted, _ = pipeline.head_outputs(images)
        finally:
            pipeline.head.classification_head.__class__ = RetinaNetClassificationHead
    assert torch.equal(shifted, plain + 1.0)


@pytest.mark.parametrize("image_size", [SIZE, (48, 80)], ids=["fixed", "resized"])
def test_pipeline_detections_equal_torchvision(model, image_size):
    pipeline = RetinaNetPipeline(model, image_size)
    images = sample_images(3, image_size)
    with torch.no_grad():
        reference = model(list(images))
        boxes, scores, labels, num = pipeline(images)
        as_list = DetectionsAsList(pipeline)(list(images))
    assert boxes.shape == (3, model.detections_per_img, 4)
    assert num.dtype == torch.int64 and labels.dtype == torch.int64
    for i, n in enumerate(num.tolist()):
        assert (labels[i, n:] == -1).all() and (scores[i, n:] == 0).all()
        assert n == len(reference[i]["scores"])
    result = compare_detections(reference, as_list, iou_threshold=0.99, min_f1=0.99)
    assert result.passed, result.summary()


def test_model_is_not_modified(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipeline = RetinaNetPipeline(model, SIZE)
    with torch.no_grad():
        pipeline(sample_images(1, SIZE))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_errors_name_the_argument(model):
    pipeline = RetinaNetPipeline(model, SIZE)
    with pytest.raises(ValueError, match=r"images: expected a tensor \[B, 3, 64, 96\]"):
        pipeline(torch.rand(1, 3, 32, 32))
    with pytest.raises(ValueError, match="images: expected images of one size"):
        DetectionsAsList(pipeline)([torch.rand(3, 64, 96), torch.rand(3, 32, 32)])
    with pytest.raises(TypeError, match="model: expected a torchvision"):
        RetinaNetPipeline(torch.nn.Linear(2, 2), SIZE)
    with pytest.raises(ValueError, match="image_size"):
        RetinaNetPipeline(model, (0, 5))
    with pytest.raises(ValueError, match="backbone must be one of"):
        build_retinanet(SIZE, backbone="vgg")


def test_half_network_keeps_float32_postprocessing(model):
    import copy

    pipeline = RetinaNetPipeline(copy.deepcopy(model), (48, 80)).to(torch.bfloat16)
    assert pipeline.anchors.dtype == torch.float32
    assert pipeline.transform.box_scale.dtype == torch.float32
    assert next(pipeline.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        boxes, scores, _, _ = pipeline(sample_images(1, (48, 80), dtype=torch.bfloat16))
    assert boxes.dtype == torch.float32 and scores.dtype == torch.float32


@pytest.mark.slow
def test_the_v2_builtin_is_torchvisions_v2_and_its_pipeline_equals_it():
    # retinanet_resnet50_fpn_v2: GroupNorm in both heads, P6 made from C5 (2048 channels).
    from bladesmith.cli.models import model_or_file

    v2 = model_or_file("torchvision:retinanet_resnet50_fpn_v2", SIZE, num_classes=5)
    norms = [m for m in v2.head.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and v2.backbone.fpn.extra_blocks.p6.in_channels == 2048
    pipeline = RetinaNetPipeline(v2, SIZE)
    images = sample_images(2, SIZE)
    counts = pipeline.candidates_per_level(images)
    assert all(c >= min(1200, n * 5) for c, n in zip(counts, pipeline.level_sizes))
    with torch.no_grad():
        reference = v2(list(images))
        as_list = DetectionsAsList(pipeline)(list(images))
    assert min(len(image["scores"]) for image in reference) >= 50
    result = compare_detections(reference, as_list, iou_threshold=0.99, min_f1=0.99)
    assert result.passed, result.summary()
