import pytest
import torch
from family_testing import (
    as_list,
    assert_captured_whole,
    assert_exports,
    assert_onnx_runs_as_pytorch,
    assert_padded_equal_reference,
    assert_realistic,
    assert_torchscript_loads_in_a_new_process,
    exact_torchvision_nms,
)
from torchvision.models.detection.roi_heads import paste_masks_in_image

from bladesmith.families.rcnn import (
    DETECTION_OUTPUTS,
    MASK_OUTPUTS,
    FasterRCNNPipeline,
    MaskRCNNPipeline,
    build_rcnn,
    calibrate_rcnn,
    paste_masks,
)
from bladesmith.images import sample_images
from engine_testing import cuda

SIZE = (160, 224)
# Fewer proposals than torchvision's 1,000 keep the CPU tests short; every step is the
# same at any count.
SMALL = dict(num_classes=5, rpn_pre_nms_top_n_test=300, rpn_post_nms_top_n_test=200)
# With fixed shapes the box predictor runs on every proposal slot (B x post_nms_top_n
# rows), torchvision on the valid ones only: the CPU's matrix product picks its kernel by
# the row count, so the class logits round differently and a score moves by up to 7e-7
# (measured on the one-tensor backbone), past the default 5e-7 of equal arithmetic.
FIXED_SHAPES = dict(score_atol=2e-6)


def tolerance(fixed_shapes):
    return FIXED_SHAPES if fixed_shapes else {}


@pytest.fixture(scope="module")
def faster():
    model = build_rcnn("fasterrcnn_mobilenet_v3_large_fpn", SIZE, **SMALL)
    return model, FasterRCNNPipeline(model, SIZE)


@pytest.fixture(scope="module")
def mask():
    model = build_rcnn("maskrcnn_resnet50_fpn", SIZE, **SMALL)
    return model, MaskRCNNPipeline(model, SIZE)


def run_both(model, pipeline, images):
    with torch.no_grad(), exact_torchvision_nms():
        return model(list(images)), pipeline(images)


@pytest.mark.parametrize("fixed_shapes", [None, True], ids=["cpu-compacted", "gpu-fixed"])
def test_faster_rcnn_equals_the_torchvision_model(faster, fixed_shapes):
    """Both RoI paths: the CPU's (valid proposals only, each level its own boxes) and
    the GPU's fixed shapes (every level pools every slot), here run on the CPU."""
    model, _ = faster
    pipeline = FasterRCNNPipeline(model, SIZE)
    pipeline.fixed_shapes = fixed_shapes
    reference, outputs = run_both(model, pipeline, sample_images(3, SIZE))
    assert_realistic(reference, 50)
    assert outputs[0].shape == (3, model.roi_heads.detections_per_img, 4)
    assert_padded_equal_reference(outputs, reference, **tolerance(fixed_shapes))


def test_a_resized_input_equals_the_torchvision_model(faster):
    model, _ = faster
    pipeline = FasterRCNNPipeline(model, (120, 200))
    reference, outputs = run_both(model, pipeline, sample_images(2, (120, 200)))
    assert_realistic(reference, 20)
    assert_padded_equal_reference(outputs, reference)


def docstring_example():
    """torchvision's FasterRCNN docstring example: a backbone returning one tensor
    (MobileNetV2's features, no FPN), which torchvision names level "0"."""
    import torchvision
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    backbone = torchvision.models.mobilenet_v2(weights=None).features
    backbone.out_channels = 1280
    anchors = AnchorGenerator(sizes=((32, 64, 128, 256, 512),), aspect_ratios=((0.5, 1.0, 2.0),))
    pool = MultiScaleRoIAlign(featmap_names=["0"], output_size=7, sampling_ratio=2)
    model = FasterRCNN(
        backbone,
        rpn_anchor_generator=anchors,
        box_roi_pool=pool,
        min_size=min(SIZE),
        max_size=max(SIZE),
        **SMALL,
    )
    return model.eval()


@pytest.mark.parametrize("fixed_shapes", [None, True], ids=["cpu-compacted", "gpu-fixed"])
def test_a_backbone_returning_one_tensor_equals_the_torchvision_model(fixed_shapes):
    model = docstring_example()
    calibrate_rcnn(model, SIZE)  # random logits score every anchor and class alike
    pipeline = FasterRCNNPipeline(model, SIZE)
    pipeline.fixed_shapes = fixed_shapes
    assert list(pipeline.grid_sizes) == ["0"]
    reference, outputs = run_both(model, pipeline, sample_images(2, SIZE))
    assert_realistic(reference, 20)
    assert_padded_equal_reference(outputs, reference, **tolerance(fixed_shapes))


def test_a_backbone_failing_on_fake_tensors_logs_no_traceback(capfd):
    """Its error is the pass's, reported in one line; torch's fake tensors log it with a
    traceback on stderr first, unless silenced."""

    class Sparse(torch.nn.Module):
        def forward(self, images):
            return {"0": images.values()}  # no strided tensor has values()

    model = docstring_example()
    model.backbone = Sparse()
    with pytest.raises(RuntimeError, match="sparse tensor layout"):
        FasterRCNNPipeline(model, SIZE)
    assert "Traceback" not in capfd.readouterr().err


def test_proposals_equal_torchvisions_rpn(faster):
    from torchvision.models.detection.image_list import ImageList

    model, pipeline = faster
    images = sample_images(2, SIZE)
    with torch.no_grad(), exact_torchvision_nms():
        features = pipeline.features(images)
        batch = ImageList(pipeline.transform(images), [pipeline.transform.resized_size] * 2)
        reference, _ = model.rpn(batch, features)
        proposals, valid = pipeline.proposals(features)
    assert proposals.shape == (2, pipeline.post_nms_top_n, 4)
    for i, expected in enumerate(reference):
        n = int(valid[i].sum())
        assert n == len(expected) and valid[i, :n].all()
        assert torch.equal(proposals[i, :n], expected)  # same order: by score, as NMS keeps


def test_no_detection_over_the_threshold_gives_only_padding(faster):
    model, pipeline = faster
    images = sample_images(1, SIZE)
    pipeline.score_threshold, saved = 1.0, pipeline.score_threshold
    try:
        with torch.no_grad():
            boxes, scores, labels, num = pipeline(images)
    finally:
        pipeline.score_threshold = saved
    assert num.tolist() == [0] and (labels == -1).all() and (boxes == 0).all()


@pytest.mark.parametrize(
    "fixed_shapes",
    [None, pytest.param(True, marks=pytest.mark.slow)],  # fixed shapes: fast in Faster R-CNN
    ids=["cpu-compacted", "gpu-fixed"],
)
def test_mask_rcnn_equals_the_torchvision_model(mask, fixed_shapes):
    model, _ = mask
    pipeline = MaskRCNNPipeline(model, SIZE)
    pipeline.fixed_shapes = fixed_shapes
    reference, outputs = run_both(model, pipeline, sample_images(2, SIZE))
    assert_realistic(reference, 50)
    assert_padded_equal_reference(outputs, reference, **tolerance(fixed_shapes))
    masks = outputs[4]
    assert masks.shape == (2, model.roi_heads.detections_per_img, 1, *SIZE)
    for i, detections in enumerate(reference):
        n = int(outputs[3][i])
        # Equal scores aside, the order is torchvision's: masks compare slot by slot.
        assert torch.allclose(masks[i, :n], detections["masks"], atol=1e-5)
        assert (masks[i, n:] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_paste_masks_equals_torchvision(seed):
    g = torch.Generator().manual_seed(seed)
    masks = torch.rand(40, 1, 28, 28, generator=g)
    # Some cross the image's edges (torchvision fails on boxes wholly outside it).
    corner = torch.rand(40, 2, generator=g) * 100 - 20
    extent = torch.rand(40, 2, generator=g) * 80 + 25
    corner[:5] = torch.rand(5, 2, generator=g) * 80
    extent[:5] = torch.rand(5, 2, generator=g) * 0.5  # under a pixel
    boxes = torch.cat([corner, corner + extent], dim=1)
    expected = paste_masks_in_image(masks, boxes, (90, 110))
    # The same arithmetic but for the order of additions: float32 rounding apart.
    assert torch.allclose(paste_masks(masks[:, 0], boxes, (90, 110)), expected[:, 0], atol=1e-5)


@pytest.mark.slow
def test_torchscript_save_loads_in_a_new_process(mask, tmp_path):
    # RoIAlign is torchvision's operator: the fresh process imports torchvision for it.
    assert_torchscript_loads_in_a_new_process(
        mask[1], sample_images(1, SIZE), tmp_path, imports=("torchvision",)
    )


@pytest.mark.slow
def test_torch_export(faster):
    assert_exports(faster[1], sample_images(2, SIZE))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["domain", "standard"])
def test_onnx_runtime_gives_pytorchs_detections(faster, tmp_path, mode):
    assert_onnx_runs_as_pytorch(
        faster[1], sample_images(2, SIZE), tmp_path, mode, DETECTION_OUTPUTS
    )


@pytest.mark.slow
def test_mask_rcnn_onnx_runtime_gives_pytorchs_masks(mask, tmp_path):
    from torchvision.ops import box_iou

    expected, got = assert_onnx_runs_as_pytorch(
        mask[1], sample_images(1, SIZE), tmp_path, "standard", MASK_OUTPUTS
    )
    n = int(expected[3][0])
    # Near-equal scores may swap slots: each detection's mask is compared with its match
    # (same label, IoU > 0.99). ONNX Runtime's RoiAlign rounds differently, and a box
    # moved by 1e-3 px can cross a whole pixel where the paste truncates: so the mean
    # difference per mask, not the largest.
    iou = box_iou(got[0][0, :n], expected[0][0, :n])
    iou = iou * (got[2][0, :n, None] == expected[2][0, None, :n])
    best, match = iou.max(dim=1)
    assert (best > 0.99).all()
    difference = (got[4][0, :n] - expected[4][0, match]).abs().flatten(1).mean(1)
    assert difference.max() < 1e-3, difference


def test_errors_name_the_argument(faster):
    with pytest.raises(TypeError, match="model: expected a torchvision Faster R-CNN"):
        FasterRCNNPipeline(torch.nn.Linear(2, 2), SIZE)
    with pytest.raises(TypeError, match="model: expected a torchvision Mask R-CNN"):
        MaskRCNNPipeline(faster[0], SIZE)
    with pytest.raises(ValueError, match="variant must be one of"):
        build_rcnn("keypointrcnn_resnet50_fpn")
    assert as_list(faster[1](sample_images(1, SIZE)))[0]["boxes"].shape[1] == 4


@cuda
@pytest.mark.parametrize("which", ["faster", "mask"])
def test_the_whole_two_stage_pipeline_is_one_cuda_graph(which, request):
    _, pipeline = request.getfixturevalue(which)
    assert_captured_whole(pipeline, sample_images(2, SIZE))
