"""torchvision SSD and SSDlite as fixed-shape pipelines.

SSD scores with a softmax over the classes and a background class, decodes every box
against its default box (``BoxCoder`` weights 10, 10, 5, 5), and keeps, per class, the
``topk_candidates`` best scores over the threshold before a class-aware NMS. Images are
resized to the model's fixed size, so the default boxes are computed once.
``SSDPipeline`` does the same with ``detection_steps`` and
``torch.ops.bladesmith.batched_nms``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.families import calibration
from bladesmith.families import detection_steps as steps
from bladesmith.families.base import DetectionFamily


class SSDPipeline(steps.OneStagePipeline):
    """A torchvision SSD (or SSDlite) for one fixed image size, with padded outputs.

    ``forward(images[B, 3, H, W] float in [0, 1]) -> (boxes[B, D, 4], scores[B, D],
    labels[B, D] int64, num_detections[B] int64)``, D = ``model.detections_per_img``: the
    detections of ``model(list(images))``, slots past ``num_detections`` padded (box 0,
    score 0, label -1). Shares ``model``'s backbone and head without modifying them.
    """

    def __init__(self, model: nn.Module, image_size: tuple[int, int]):
        from torchvision.models.detection.ssd import SSD

        super().__init__(model, image_size, SSD, "SSD")

    def head_outputs(self, images: torch.Tensor):
        """Class logits [B, N, C] (class 0 the background) and box deltas [B, N, 4]."""
        out = self.head(self.features(images))
        return out["cls_logits"], out["bbox_regression"]

    def forward(self, images: torch.Tensor):
        return self.postprocess(*(x.float() for x in self.head_outputs(images)))

    def postprocess(self, cls_logits: torch.Tensor, bbox_regression: torch.Tensor):
        """torchvision's ``SSD.postprocess_detections`` with fixed shapes, then the boxes
        scaled to the input images."""
        batch, num_anchors, num_classes = cls_logits.shape
        boxes = steps.decode_boxes(
            self.box_coder, bbox_regression, self.anchors.expand(batch, -1, -1)
        )
        boxes = steps.clip_boxes(boxes, self.transform.resized_size)
        # Per foreground class: [B, C - 1, N], the class's best over the anchors.
        scores = F.softmax(cls_logits, dim=-1)[..., 1:].transpose(1, 2)
        passing = scores > self.score_threshold
        count = min(self.topk_candidates, int(num_anchors))
        best, anchor = scores.masked_fill(~passing, -math.inf).topk(count, dim=2)
        valid = passing.gather(2, anchor).flatten(1)
        labels = torch.arange(1, int(num_classes), device=anchor.device).view(1, -1, 1)
        boxes, scores, labels = steps.as_padding(
            steps.gather_rows(boxes, anchor.flatten(1)),
            best.flatten(1),
            labels.expand_as(anchor).flatten(1),
            valid,
        )
        boxes, scores, labels, num = steps.batched_nms(
            boxes, scores, labels, self.iou_threshold, self.max_detections
        )
        return self.transform.to_image(boxes), scores, labels, num


def build_ssd(
    variant: str = "ssdlite320_mobilenet_v3_large",
    realistic_load: bool = True,
    num_classes: int = 91,
    seed: int = 0,
) -> nn.Module:
    """A seeded random-weight torchvision SSD in eval mode (it resizes every image to
    its own fixed size); with ``realistic_load`` its class logits spread as a trained
    model's, so that scores over the threshold are many and varied."""
    from torchvision.models import detection, list_models

    # Every SSD builder torchvision has: ssd300_vgg16, ssdlite320_mobilenet_v3_large.
    variants = [name for name in list_models(detection) if name.startswith("ssd")]
    if variant not in variants:
        raise ValueError(f"variant must be one of {', '.join(variants)}; got {variant!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(detection, variant)(
            weights=None, weights_backbone=None, num_classes=num_classes
        )
    model.eval()
    if realistic_load:
        calibrate_ssd(model)
    return model


@torch.no_grad()
def calibrate_ssd(model: nn.Module) -> None:
    """Batch norms fitted to real photographs, then each level's classification layer
    scaled so that its logits spread with ``calibration.LOGIT_STD`` (random ones barely
    move the softmax from 1 / C, all scores alike)."""
    size = tuple(model.transform.fixed_size[::-1])
    pipeline = SSDPipeline(model, size)
    photos = calibration.photos(size)
    calibration.fit_batch_norms(model, lambda: pipeline.head_outputs(photos))
    features = pipeline.features(photos)
    for level, feature in zip(model.head.classification_head.module_list, features):
        layer = level[-1] if isinstance(level, nn.Sequential) else level  # SSDlite's
        layer.bias.zero_()
        layer.weight.mul_(calibration.LOGIT_STD / level(feature).std().clamp_min(1e-12))


class SSDFamily(DetectionFamily):
    """torchvision's SSD and SSDlite: ``SSDPipeline``."""

    name = "ssd"

    def detects(self, model) -> bool:
        from torchvision.models.detection.ssd import SSD

        return isinstance(model, SSD)

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        return SSDPipeline(model, image_size)

    def load_note(self, pipeline: nn.Module, batch: torch.Tensor) -> str:
        return steps.detections_note("SSD", pipeline, batch, "build_ssd")


FAMILY = SSDFamily()
