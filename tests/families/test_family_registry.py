import pytest
import torch
from torchvision.models import detection

from bladesmith.families import family_named, family_of
from bladesmith.families.rcnn import MaskRCNNPipeline

KINDS = {
    "fcos_resnet50_fpn": "fcos",
    "ssd300_vgg16": "ssd",
    "ssdlite320_mobilenet_v3_large": "ssd",
    "fasterrcnn_mobilenet_v3_large_320_fpn": "faster_rcnn",
    "maskrcnn_resnet50_fpn": "mask_rcnn",
    "keypointrcnn_resnet50_fpn": None,  # no keypoint family: left as it is
}


@pytest.mark.parametrize("builder, family", KINDS.items(), ids=KINDS.keys())
def test_each_torchvision_detector_finds_its_family(builder, family):
    model = getattr(detection, builder)(weights=None, weights_backbone=None, num_classes=2)
    found = family_of(model.eval())
    assert (found and found.name) == family
    if family:
        assert family_named(family) is found


def test_mask_rcnn_family_gives_masks_to_the_user():
    model = detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=2, min_size=64, max_size=96
    ).eval()
    family = family_of(model)
    pipeline = family.adapt(model, (64, 96))
    assert isinstance(pipeline, MaskRCNNPipeline)
    with torch.no_grad():
        outputs = pipeline(torch.rand(2, 3, 64, 96))
    assert len(outputs) == len(family.output_names) == 5
    detections = family.to_user(outputs)
    for image, count in zip(detections, outputs[3].tolist()):
        assert image["masks"].shape == (count, 1, 64, 96)


def test_mask_rcnn_family_compares_the_masks():
    """The gate judges the masks of matched detections (it used to drop them)."""
    torch.manual_seed(0)
    model = detection.maskrcnn_resnet50_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=2,
        min_size=64,
        max_size=96,
        box_score_thresh=0.0,  # random weights: keep some detections
        rpn_post_nms_top_n_test=20,
        box_detections_per_img=5,
    ).eval()
    family = family_of(model)
    images = torch.rand(1, 3, 64, 96)
    with torch.no_grad():
        reference = model(list(images))
        detections = family.to_user(family.adapt(model, (64, 96))(images))
    same = family.compare(reference, detections)
    assert same.passed and "max mask dev 0% of its box's area" in same.summary(), same.summary()
    inverted = [dict(image, masks=1 - image["masks"]) for image in detections]
    wrong = family.compare(reference, inverted)
    assert not wrong.passed and "matched masks moved past tolerance" in wrong.summary()


def test_artifacts_load_with_torchvisions_operators():
    """R-CNN artifacts call torchvision::roi_align: loading makes it available."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from bladesmith.ops import load_builtin\n"
        "assert load_builtin() is None\n"
        "torch.ops.torchvision.roi_align.default\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
