import pytest
import torch
from family_testing import (
    as_list,
    assert_exports,
    assert_onnx_runs_as_pytorch,
    assert_padded_equal_reference,
    assert_realistic,
    assert_torchscript_loads_in_a_new_process,
    exact_torchvision_nms,
    pipeline_settings,
    settings_of,
)
from torchvision.models.detection import FCOS

from bladesmith.families.fcos import FCOSPipeline, build_fcos
from bladesmith.images import sample_images
from bladesmith.verify import compare_detections

SIZE = (160, 224)
OUTPUTS = ("boxes", "scores", "labels", "num_detections")


@pytest.fixture(scope="module")
def model():
    return build_fcos(SIZE, backbone="resnet18", num_classes=5)


@pytest.fixture(scope="module")
def pipeline(model):
    return FCOSPipeline(model, SIZE)


def head_outputs(pipeline, seed, batch=2, classes=5, logit_mean=-1.0, quantum=None):
    g = torch.Generator().manual_seed(seed)
    n = pipeline.anchors.shape[0]
    cls_logits = torch.randn(batch, n, classes, generator=g) * 2 + logit_mean
    ctrness = torch.randn(batch, n, 1, generator=g) * 2
    if quantum is not None:  # few distinct values: many equal scores
        cls_logits = (cls_logits / quantum).round() * quantum
        ctrness = (ctrness / quantum).round() * quantum
    regression = torch.rand(batch, n, 4, generator=g) * 3
    return cls_logits, regression, ctrness


def torchvision_postprocess(pipeline, model, outputs, **overrides):
    cls_logits, regression, ctrness = outputs
    sizes = pipeline.level_sizes
    head = {
        "cls_logits": list(cls_logits.split(sizes, dim=1)),
        "bbox_regression": list(regression.split(sizes, dim=1)),
        "bbox_ctrness": list(ctrness.split(sizes, dim=1)),
    }
    anchors = [list(pipeline.anchors.split(sizes))] * len(cls_logits)
    shapes = [pipeline.transform.resized_size] * len(cls_logits)
    with exact_torchvision_nms():
        return FCOS.postprocess_detections(settings_of(model, **overrides), head, anchors, shapes)


CASES = {
    "random": dict(seed=1),
    "more candidates than top-k": dict(seed=2, logit_mean=2.0, topk_candidates=50),
    "all below the threshold": dict(seed=3, logit_mean=-12.0),
    # Which of two equal scores NMS keeps is the order of equal scores, which no
    # implementation fixes (torch.topk's is unspecified): equal scores without NMS.
    "equal scores": dict(
        seed=4, quantum=0.5, topk_candidates=10**6, nms_thresh=2.0, detections_per_img=5000
    ),
    "few detections kept": dict(seed=5, logit_mean=1.0, detections_per_img=7),
    "no suppression": dict(seed=6, nms_thresh=2.0, detections_per_img=1000),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_postprocess_equals_torchvision(pipeline, model, case):
    case = dict(case)
    inputs = {k: case.pop(k) for k in ("seed", "logit_mean", "quantum") if k in case}
    outputs = head_outputs(pipeline, **inputs)
    reference = torchvision_postprocess(pipeline, model, outputs, **case)
    with pipeline_settings(pipeline, **case):
        ours = pipeline.postprocess(*outputs)
    assert ours[0].shape == (2, case.get("detections_per_img", 100), 4)
    assert_padded_equal_reference(ours, reference)
    if inputs.get("logit_mean") == -12.0:
        assert ours[3].tolist() == [0, 0]


@pytest.mark.parametrize("image_size", [SIZE, (120, 200)], ids=["fixed", "resized"])
def test_pipeline_equals_the_torchvision_model(model, image_size):
    pipeline = FCOSPipeline(model, image_size)
    images = sample_images(3, image_size)
    with torch.no_grad():
        reference = model(list(images))
        outputs = pipeline(images)
    assert_realistic(reference, model.detections_per_img)
    assert_padded_equal_reference(outputs, reference)


def test_realistic_load_is_busy(model, pipeline):
    with torch.no_grad():
        cls_logits, _, ctrness = pipeline.head_outputs(sample_images(3, SIZE))
    scores = torch.sqrt(cls_logits.sigmoid() * ctrness.sigmoid())
    passing = (scores > model.score_thresh).flatten(2).sum(-1)  # [B, N]
    first_level = passing[:, : pipeline.level_sizes[0]].sum(1)
    assert first_level.min() >= 1000


@pytest.mark.slow
def test_torchscript_save_loads_in_a_new_process(pipeline, tmp_path):
    assert_torchscript_loads_in_a_new_process(pipeline, sample_images(2, SIZE), tmp_path)


@pytest.mark.slow
def test_torch_export(pipeline):
    assert_exports(pipeline, sample_images(2, SIZE))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["domain", "standard"])
def test_onnx_runtime_gives_pytorchs_detections(pipeline, model, tmp_path, mode):
    images = sample_images(2, SIZE)
    expected, _ = assert_onnx_runs_as_pytorch(pipeline, images, tmp_path, mode, OUTPUTS)
    with torch.no_grad():
        reference = model(list(images))
    assert compare_detections(reference, as_list(expected)).passed


def test_errors_name_the_argument(model):
    pipeline = FCOSPipeline(model, SIZE)
    with pytest.raises(ValueError, match=r"images: expected a tensor \[B, 3, 160, 224\]"):
        pipeline(torch.rand(1, 3, 32, 32))
    with pytest.raises(TypeError, match="model: expected a torchvision FCOS"):
        FCOSPipeline(torch.nn.Linear(2, 2), SIZE)
    with pytest.raises(ValueError, match="backbone must be one of"):
        build_fcos(SIZE, backbone="vgg")
