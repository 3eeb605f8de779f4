"""torchvision FCOS as a fixed-shape pipeline.

FCOS post-processes as RetinaNet does, except that a candidate's score is
``sqrt(sigmoid(class logit) * sigmoid(centerness))`` (taken before the threshold) and its
box is coded as distances from the location's centre (``BoxLinearCoder``, scaled by the
anchor's size). ``FCOSPipeline`` composes the steps of ``detection_steps`` with
``torch.ops.bladesmith.batched_nms``.
"""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.families import calibration
from bladesmith.families import detection_steps as steps
from bladesmith.families.base import DetectionFamily


class FCOSPipeline(steps.OneStagePipeline):
    """A torchvision FCOS for one fixed image size, with padded outputs.

    ``forward(images[B, 3, H, W] float in [0, 1]) -> (boxes[B, D, 4], scores[B, D],
    labels[B, D] int64, num_detections[B] int64)``, D = ``model.detections_per_img``: the
    detections of ``model(list(images))``, slots past ``num_detections`` padded (box 0,
    score 0, label -1). Shares ``model``'s backbone and head without modifying them.
    """

    def __init__(self, model: nn.Module, image_size: tuple[int, int]):
        from torchvision.models.detection import FCOS

        super().__init__(model, image_size, FCOS, "FCOS")
        self.num_classes = int(model.head.classification_head.num_classes)

    def head_outputs(self, images: torch.Tensor):
        """Class logits [B, N, C], box regression [B, N, 4], centerness [B, N, 1]."""
        out = self.head(self.features(images))
        return out["cls_logits"], out["bbox_regression"], out["bbox_ctrness"]

    def forward(self, images: torch.Tensor):
        return self.postprocess(*(x.float() for x in self.head_outputs(images)))

    def postprocess(self, cls_logits, bbox_regression, bbox_ctrness):
        """torchvision's ``FCOS.postprocess_detections`` with fixed shapes, then the
        boxes scaled to the input images."""
        scores = torch.sqrt(torch.sigmoid(cls_logits) * torch.sigmoid(bbox_ctrness))
        scores, anchor, labels, valid = steps.top_per_level(
            scores, self.level_sizes, self.num_classes, self.topk_candidates, self.score_threshold
        )
        boxes = self.box_coder.decode(
            steps.gather_rows(bbox_regression, anchor),
            steps.gather_rows(self.anchors, anchor),
        )
        boxes = steps.clip_boxes(boxes, self.transform.resized_size)
        boxes, scores, labels, num = steps.batched_nms(
            *steps.as_padding(boxes, scores, labels, valid), self.iou_threshold, self.max_detections
        )
        return self.transform.to_image(boxes), scores, labels, num


BACKBONES = ("resnet50", "resnet18")
# Candidates over the threshold on each level of a realistically loaded model (a trained
# FCOS on a busy image keeps over 1,000 on its large levels).
_REALISTIC_CANDIDATES = 1200
# Spread of the calibrated box sides, in anchor sizes around one.
_BOX_SIDE_STD = 0.25


def build_fcos(
    image_size: tuple[int, int] = (480, 640),
    realistic_load: bool = True,
    num_classes: int = 91,
    backbone: str = "resnet50",
    seed: int = 0,
) -> nn.Module:
    """A seeded random-weight torchvision FCOS in eval mode whose transform keeps
    ``image_size`` as is; with ``realistic_load`` calibrated so that every level keeps
    at least 1,200 candidates (or all) over the score threshold on real photographs."""
    from torchvision.models.detection import FCOS, fcos_resnet50_fpn

    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {', '.join(BACKBONES)}; got {backbone!r}")
    height, width = steps.check_image_size(image_size)
    sizes = {"min_size": min(height, width), "max_size": max(height, width)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if backbone == "resnet50":
            model = fcos_resnet50_fpn(
                weights=None, weights_backbone=None, num_classes=num_classes, **sizes
            )
        else:
            body = steps.resnet18_p3_p7_body()
            model = FCOS(body, num_classes, **sizes)
    model.eval()
    if realistic_load:
        calibrate_fcos(model, (height, width))
    return model


@torch.no_grad()
def calibrate_fcos(model: nn.Module, image_size: tuple[int, int]) -> None:
    """Centerness logits spread around sigmoid 0.73, class logits shifted so that the
    1,200 best of each level pass the score threshold wherever the centerness is at
    least one half (sqrt(class * centerness) > threshold)."""
    cls_layer = model.head.classification_head.cls_logits
    ctr_layer = model.head.regression_head.bbox_ctrness
    reg_layer = model.head.regression_head.bbox_reg
    pipeline = FCOSPipeline(model, image_size)
    for layer in (cls_layer, ctr_layer, reg_layer):
        layer.bias.zero_()
    images = calibration.photos(image_size)
    cls_raw, positive, ctr_raw = pipeline.head_outputs(images)
    # The head's ReLU hides the negative half of the box outputs: the negated layer
    # shows it. Box sides then spread around the anchor's size, never at 0 (a random
    # head's ReLU zeros half of them, leaving boxes of no area whose overlaps make NMS
    # arbitrary).
    reg_layer.weight.neg_()
    negative = pipeline.head_outputs(images)[1]
    reg_layer.weight.neg_()
    raw = positive - negative
    scale = _BOX_SIDE_STD / raw.std().clamp_min(1e-12)
    reg_layer.weight.mul_(scale)
    reg_layer.bias.fill_(1.0 - float(raw.mean() * scale))
    ctr_layer.weight.mul_(calibration.LOGIT_STD / ctr_raw.std().clamp_min(1e-12))
    ctr_layer.bias.fill_(1.0)
    target = calibration.logit(min(2 * model.score_thresh**2, 0.5))
    calibration.calibrate(cls_layer, cls_raw, pipeline.level_sizes, target, _REALISTIC_CANDIDATES)


class FCOSFamily(DetectionFamily):
    """torchvision's FCOS: ``FCOSPipeline``."""

    name = "fcos"

    def detects(self, model) -> bool:
        from torchvision.models.detection import FCOS

        return isinstance(model, FCOS)

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        return FCOSPipeline(model, image_size)

    def load_note(self, pipeline: nn.Module, batch: torch.Tensor) -> str:
        return steps.detections_note("FCOS", pipeline, batch, "build_fcos")


FAMILY = FCOSFamily()
