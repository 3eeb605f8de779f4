"""The built-in RetinaNet: torchvision's, with random weights calibrated so that
post-processing works as hard as for a trained model on a busy image (or a local
state-dict file's weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bladesmith.families import calibration
from bladesmith.families.detection_steps import check_image_size
from bladesmith.families.retinanet import RetinaNetPipeline
from bladesmith.models.weights import load_weights

# resnet50_v2: torchvision's retinanet_resnet50_fpn_v2 (GroupNorm in the heads, P6 from C5).
BACKBONES = ("resnet50", "resnet18", "resnet50_v2")
# Each level of a realistically loaded model keeps at least this many candidates over
# the score threshold (a trained RetinaNet on a busy image keeps well over 1,000).
_REALISTIC_CANDIDATES = 1200


def build_retinanet(
    image_size: tuple[int, int] = (480, 640),
    weights: str | Path | None = None,
    realistic_load: bool = True,
    num_classes: int = 91,
    backbone: str = "resnet50",
    seed: int = 0,
) -> nn.Module:
    """A torchvision RetinaNet in eval mode whose transform keeps ``image_size`` as is.

    ``weights`` is a local state-dict file (nothing is downloaded); without it the
    weights are random (seeded, so every call builds the same model) and, with
    ``realistic_load``, the classification layer is calibrated on real photographs so
    that at least 1,200 candidates per level pass the score threshold, spread over a
    trained model's range of scores: post-processing then works as hard as it does
    for a trained model on a busy image.
    """
    from torchvision.models import resnet18
    from torchvision.models.detection import retinanet_resnet50_fpn, retinanet_resnet50_fpn_v2
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.models.detection.retinanet import RetinaNet
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {', '.join(BACKBONES)}; got {backbone!r}")
    height, width = check_image_size(image_size)
    # min_size/max_size equal to the image's sides make the transform's resize a no-op.
    sizes = {"min_size": min(height, width), "max_size": max(height, width)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if backbone in ("resnet50", "resnet50_v2"):
            build = retinanet_resnet50_fpn if backbone == "resnet50" else retinanet_resnet50_fpn_v2
            model = build(weights=None, weights_backbone=None, num_classes=num_classes, **sizes)
        else:
            body = _resnet_fpn_extractor(
                resnet18(), 5, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256)
            )
            model = RetinaNet(body, num_classes, **sizes)
    model.eval()
    if weights is not None:
        load_weights(model, weights)
    elif realistic_load:
        calibrate_for_realistic_load(model, (height, width))
    return model


@torch.no_grad()
def calibrate_for_realistic_load(model: nn.Module, image_size: tuple[int, int]) -> None:
    """Scale and shift the classification layer of a random-weight RetinaNet so that
    every level keeps at least 1,200 candidates over the score threshold on real
    photographs, with logits spread like a trained model's."""
    pipeline = RetinaNetPipeline(model, image_size)
    cls_layer = model.head.classification_head.cls_logits
    cls_layer.bias.zero_()
    raw = pipeline.head_outputs(calibration.photos(image_size))[0]
    target = calibration.logit(model.score_thresh)
    calibration.calibrate(cls_layer, raw, pipeline.level_sizes, target, _REALISTIC_CANDIDATES)
