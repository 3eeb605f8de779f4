"""torchvision Faster R-CNN and Mask R-CNN as fixed-shape pipelines.

Two-stage detectors are data-dependent at every step in torchvision: the region proposal
network keeps the proposals that survive its filters and NMS (a different count per
image), RoI pooling assigns each proposal to a pyramid level with ``torch.where``, the
box head's candidates are filtered again, and Mask R-CNN pastes each mask in a Python
loop at a box-dependent size. Here:

- proposals: per-level top-k of the objectness, decode, clip; small or low-scoring boxes
  become padding; class-agnostic NMS per image with the level as the label, through
  ``torch.ops.bladesmith.batched_nms``, keeps a fixed ``post_nms_top_n`` slots;
- ``MultiScaleRoIAlign`` on those slots: each box's samples gathered from its own level
  (the level assignment is torchvision's ``LevelMapper``);
- box head, per-class decode and clip, padding for the background, low scores, small
  boxes and padded proposals, then ``batched_nms``;
- Mask R-CNN: the mask head on the D detection slots, and masks pasted as torchvision's
  ``paste_masks_in_image`` does (expanded box, bilinear resize to the box's whole-pixel
  size) by two interpolation matrices per mask, in one batched matrix product.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.families import calibration
from bladesmith.families import detection_steps as steps
from bladesmith.families.base import DetectionFamily
from bladesmith.families.multilevel_roi_align import multilevel_roi_align
from bladesmith.ops import load_library, roi_align

DETECTION_OUTPUTS = ("boxes", "scores", "labels", "num_detections")
MASK_OUTPUTS = (*DETECTION_OUTPUTS, "masks")


class FasterRCNNPipeline(steps.KeepsFloat32):
    """A torchvision Faster R-CNN for one fixed image size, with padded outputs.

    ``forward(images[B, 3, H, W] float in [0, 1]) -> (boxes[B, D, 4], scores[B, D],
    labels[B, D] int64, num_detections[B] int64)``, D = ``detections_per_img``: the
    detections of ``model(list(images))``, slots past ``num_detections`` padded (box 0,
    score 0, label -1). Shares ``model``'s modules without modifying them.
    """

    float32_buffers = ("anchors",)
    # The layers that run once per region (the passes may change their precision alone).
    roi_heads = ("box_head", "box_predictor")
    # Fixed shapes for RoI pooling and the box head: None picks them on GPUs only (one
    # CUDA graph); on a CPU only the valid proposals run, each level pooling its own.
    fixed_shapes: bool | None = None

    def __init__(self, model: nn.Module, image_size: tuple[int, int]):
        super().__init__()
        from torchvision.models.detection import FasterRCNN

        steps.eval_model(model, FasterRCNN, "Faster R-CNN")
        load_library()  # forward calls torch.ops.bladesmith
        self.transform = steps.StaticTransform(model.transform, image_size)
        self.backbone = model.backbone
        rpn, heads = model.rpn, model.roi_heads
        self.rpn_head = rpn.head
        self.rpn_coder = rpn.box_coder
        self.pre_nms_top_n = int(rpn._pre_nms_top_n["testing"])
        self.post_nms_top_n = int(rpn._post_nms_top_n["testing"])
        self.rpn_iou_threshold = float(rpn.nms_thresh)
        self.rpn_min_size = float(rpn.min_size)
        self.rpn_score_threshold = float(rpn.score_thresh)
        self.box_roi_pool = heads.box_roi_pool
        self.box_head = heads.box_head
        self.box_predictor = heads.box_predictor
        self.box_coder = heads.box_coder
        self.score_threshold = float(heads.score_thresh)
        self.iou_threshold = float(heads.nms_thresh)
        self.max_detections = int(heads.detections_per_img)
        parts = SimpleNamespace(
            backbone=model.backbone,
            anchor_generator=rpn.anchor_generator,
            parameters=model.parameters,
        )
        anchors, self.grid_sizes, self.level_sizes = steps.static_anchors(
            parts, self.transform.padded_size, self.transform.resized_size
        )
        self.register_buffer("anchors", anchors, persistent=False)
        # Each proposal candidate's level, the label of the class-agnostic NMS.
        levels = [
            torch.full((min(self.pre_nms_top_n, n),), i, dtype=torch.int64)
            for i, n in enumerate(self.level_sizes)
        ]
        self.register_buffer("candidate_levels", torch.cat(levels), persistent=False)
        self.pool_levels = {"box_roi_pool": self._levels(self.box_roi_pool)}
        self.eval()  # an exporter restores the mode it found, on every submodule

    def features(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return steps.backbone_features(self.backbone, self.transform(images))

    def proposals(self, features: dict[str, torch.Tensor]):
        """The region proposal network with fixed shapes: proposals [B, P, 4] (resized
        image coordinates) and valid [B, P], P = ``post_nms_top_n``."""
        from torchvision.models.detection.rpn import concat_box_prediction_layers

        objectness, deltas = self.rpn_head(list(features.values()))
        batch = objectness[0].shape[0]
        objectness, deltas = concat_box_prediction_layers(objectness, deltas)
        objectness = objectness.view(batch, -1, 1).float()
        deltas = deltas.view(batch, -1, 4).float()
        # Every anchor competes: -inf passes, NaN does not (torchvision's top-k takes it).
        best, anchor, _, _ = steps.top_per_level(
            objectness, self.level_sizes, 1, self.pre_nms_top_n, -float("inf"), strict=False
        )
        boxes = steps.decode_boxes(
            self.rpn_coder,
            steps.gather_rows(deltas, anchor),
            steps.gather_rows(self.anchors, anchor),
        )
        boxes = steps.clip_boxes(boxes, self.transform.resized_size)
        scores = torch.sigmoid(best)
        valid = steps.not_small(boxes, self.rpn_min_size) & (scores >= self.rpn_score_threshold)
        boxes, _, labels, _ = steps.batched_nms(
            *steps.as_padding(boxes, scores, self.candidate_levels.expand_as(anchor), valid),
            self.rpn_iou_threshold,
            self.post_nms_top_n,
        )
        return boxes, labels >= 0

    def _levels(self, pooler: nn.Module):
        """torchvision's scales and level mapper for ``pooler``, from the static sizes:
        computed once (torchvision infers them on a call, with host reads of tensors
        that split a compiled graph)."""
        from torchvision.ops.poolers import _setup_scales

        names = [name for name in self.grid_sizes if name in pooler.featmap_names]
        scales, mapper = _setup_scales(
            [torch.empty(1, 1, *self.grid_sizes[name]) for name in names],
            [self.transform.resized_size],
            pooler.canonical_scale,
            pooler.canonical_level,
        )
        return names, scales, mapper

    def pool(self, pooler: str, features: dict[str, torch.Tensor], boxes: torch.Tensor):
        """``MultiScaleRoIAlign`` (the attribute ``pooler``) on boxes [B, K, 4]:
        [B * K, C, h, w]."""
        batch, count = boxes.shape[:2]
        index = torch.arange(batch, device=boxes.device, dtype=boxes.dtype)
        rois = torch.cat([index.repeat_interleave(count)[:, None], boxes.reshape(-1, 4)], dim=1)
        return self.pool_rois(pooler, features, rois)

    def pool_rois(self, pooler: str, features: dict[str, torch.Tensor], rois: torch.Tensor):
        """``MultiScaleRoIAlign`` (the attribute ``pooler``) on rois [N, 5] (image index,
        box): [N, C, h, w]. On a GPU, with fixed shapes (one CUDA graph), each box gathers
        its samples from its own level (``multilevel_roi_align``; where the sampling
        ratio is adaptive, every level pools every box and each box keeps its own
        level's result); on a CPU, where nothing is captured, each level pools only its
        own boxes, as torchvision does."""
        names, scales, mapper = self.pool_levels[pooler]
        levels = [features[name] for name in names]
        pooler = getattr(self, pooler)
        size, ratio = pooler.output_size, pooler.sampling_ratio
        if len(levels) == 1:
            return roi_align(levels[0], rois, size, scales[0], ratio)
        level_of = mapper([rois[:, 1:]])
        if not self.keeps_shapes(rois):
            first = levels[0]
            pooled = first.new_zeros(rois.shape[0], first.shape[1], *size)  # size: (h, w)
            for level, (feature, scale) in enumerate(zip(levels, scales)):
                mine = torch.nonzero(level_of == level).squeeze(1)
                out = roi_align(feature, rois[mine].to(feature.dtype), size, scale, ratio)
                pooled.index_copy_(0, mine, out.to(pooled.dtype))  # in place, as torchvision
            return pooled
        if ratio > 0:
            return multilevel_roi_align(levels, rois, level_of, scales, size, ratio)
        level_of = level_of[:, None, None, None]
        pooled = None
        for level, (feature, scale) in enumerate(zip(levels, scales)):
            out = roi_align(feature, rois.to(feature.dtype), size, scale, ratio)
            pooled = out if pooled is None else torch.where(level_of == level, out, pooled)
        return pooled

    def keeps_shapes(self, tensor: torch.Tensor) -> bool:
        return self.fixed_shapes if self.fixed_shapes is not None else tensor.is_cuda

    def classify(self, features, proposals, proposal_valid):
        """(class logits [B * P, K], box regression [B * P, 4K]) of every proposal slot.
        On a CPU only the valid proposals run the head (torchvision's count, not the
        fixed ``post_nms_top_n``); the padded slots read 0 and are masked after."""
        if self.keeps_shapes(proposals):
            pooled = self.pool("box_roi_pool", features, proposals)
            return self.box_predictor(self.box_head(pooled))
        valid = proposal_valid.reshape(-1)
        pooled = self.pool_rois("box_roi_pool", features, _valid_rois(proposals, valid))
        return _per_slot(self.box_predictor(self.box_head(pooled)), valid)

    def detect(self, features, proposals, proposal_valid):
        """The box head on every proposal slot, per-class decode and NMS: padded
        detections in resized image coordinates."""
        batch, count = proposals.shape[:2]
        class_logits, box_regression = self.classify(features, proposals, proposal_valid)
        num_classes = class_logits.shape[-1]
        boxes = steps.decode_single(
            self.box_coder, box_regression.float(), proposals.reshape(-1, 4)
        )
        boxes = steps.clip_boxes(boxes.view(batch, count, -1, 4), self.transform.resized_size)
        scores = F.softmax(class_logits.float(), -1).view(batch, count, -1)
        # Background (class 0) dropped; each (proposal, class) one candidate.
        boxes = boxes[:, :, 1:].reshape(batch, -1, 4)
        scores = scores[:, :, 1:].reshape(batch, -1)
        labels = torch.arange(1, int(num_classes), device=boxes.device).repeat(count)
        valid = (
            (scores > self.score_threshold)
            & steps.not_small(boxes, 1e-2)
            & proposal_valid.repeat_interleave(int(num_classes) - 1, dim=1)
        )
        return steps.batched_nms(
            *steps.as_padding(boxes, scores, labels.expand(batch, -1), valid),
            self.iou_threshold,
            self.max_detections,
        )

    def forward(self, images: torch.Tensor):
        features = self.features(images)
        boxes, scores, labels, num = self.detect(features, *self.proposals(features))
        return self.transform.to_image(boxes), scores, labels, num


class MaskRCNNPipeline(FasterRCNNPipeline):
    """A torchvision Mask R-CNN for one fixed image size: ``FasterRCNNPipeline``'s
    outputs plus masks [B, D, 1, H, W] (probabilities pasted into the input image, as
    torchvision returns them; 0 in padding slots)."""

    roi_heads = (*FasterRCNNPipeline.roi_heads, "mask_head", "mask_predictor")

    def __init__(self, model: nn.Module, image_size: tuple[int, int]):
        from torchvision.models.detection import MaskRCNN

        steps.eval_model(model, MaskRCNN, "Mask R-CNN")
        super().__init__(model, image_size)
        heads = model.roi_heads
        self.mask_roi_pool = heads.mask_roi_pool
        self.mask_head = heads.mask_head
        self.mask_predictor = heads.mask_predictor
        self.pool_levels["mask_roi_pool"] = self._levels(self.mask_roi_pool)

    def forward(self, images: torch.Tensor):
        features = self.features(images)
        boxes, scores, labels, num = self.detect(features, *self.proposals(features))
        if self.keeps_shapes(boxes):
            pooled = self.pool("mask_roi_pool", features, boxes)
            logits = self.mask_predictor(self.mask_head(pooled)).float()
        else:  # on a CPU only the detections run the mask head, as in torchvision
            valid = (labels >= 0).reshape(-1)
            pooled = self.pool_rois("mask_roi_pool", features, _valid_rois(boxes, valid))
            (logits,) = _per_slot((self.mask_predictor(self.mask_head(pooled)).float(),), valid)
        # Each detection's mask is its own class's (padding reads class 0, then zeroed).
        flat_labels = labels.reshape(-1, 1, 1, 1).clamp(min=0)
        masks = logits.gather(1, flat_labels.expand(-1, 1, *logits.shape[-2:])).sigmoid()
        boxes = self.transform.to_image(boxes)
        pasted = paste_masks(masks[:, 0], boxes.reshape(-1, 4), self.transform.image_size)
        pasted = pasted.view(*labels.shape, 1, *self.transform.image_size)
        pasted = pasted * (labels >= 0)[..., None, None, None]
        return boxes, scores, labels, num, pasted


def _valid_rois(boxes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The rois [n, 5] (image index, box) of the slots of ``boxes`` [B, K, 4] that
    ``valid`` [B * K] marks."""
    slots = torch.nonzero(valid).squeeze(1)
    image = torch.div(slots, boxes.shape[1], rounding_mode="floor").to(boxes.dtype)
    return torch.cat([image[:, None], boxes.reshape(-1, 4)[slots]], dim=1)


def _per_slot(outputs: tuple[torch.Tensor, ...], valid: torch.Tensor) -> tuple:
    """Rows computed for the valid slots only, back to one row per slot: a valid slot
    reads its own row, a padded one a row of zeros appended at the end (shapes from
    tensors, so a traced batch stays free)."""
    counted = valid.long()  # ONNX's CumSum and ReduceSum take no bool
    rows = torch.where(valid, counted.cumsum(0) - 1, counted.sum())
    return tuple(
        torch.cat([out, out.new_zeros(1, *out.shape[1:])]).index_select(0, rows) for out in outputs
    )


def paste_masks(masks: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]):
    """torchvision's ``paste_masks_in_image`` for masks [K, M, M] and boxes [K, 4] in an
    image of ``size`` (height, width), with fixed shapes: [K, H, W].

    torchvision pads each mask by one pixel, scales its box by (M + 2) / M, truncates it
    to whole pixels, resizes the mask bilinearly to the box's size and copies the part
    inside the image. Each resize is linear in the mask, separably in y and x: the
    matrices ``rows`` [K, H, M + 2] and ``columns`` [K, W, M + 2] hold its weights,
    zero outside the box, so ``rows @ mask @ columns^T`` is the pasted mask.
    """
    size_m = masks.shape[-1]
    padded = F.pad(masks, (1, 1, 1, 1))
    scale = float(size_m + 2) / size_m
    w_half = (boxes[:, 2] - boxes[:, 0]) * 0.5 * scale
    h_half = (boxes[:, 3] - boxes[:, 1]) * 0.5 * scale
    x_c = (boxes[:, 2] + boxes[:, 0]) * 0.5
    y_c = (boxes[:, 3] + boxes[:, 1]) * 0.5
    corners = torch.stack([x_c - w_half, y_c - h_half, x_c + w_half, y_c + h_half], 1).long()
    height, width = size
    rows = _resize_weights(corners[:, 1], corners[:, 3], height, size_m + 2)
    columns = _resize_weights(corners[:, 0], corners[:, 2], width, size_m + 2)
    return rows @ padded @ columns.transpose(1, 2)


def _resize_weights(start, end, size: int, source: int) -> torch.Tensor:
    """[K, size, source]: row p holds the bilinear weights (align_corners=False, as
    ``F.interpolate``) of output pixel p - start of a resize from ``source`` to
    end - start + 1 pixels (at least 1); rows outside start..end are 0."""
    length = (end - start + 1).clamp(min=1)
    pixel = torch.arange(size, device=start.device)
    offset = pixel[None] - start[:, None]
    inside = (pixel[None] >= start[:, None]) & (pixel[None] <= end[:, None])
    ratio = float(source) / length.float()
    position = ((offset.float() + 0.5) * ratio[:, None] - 0.5).clamp(min=0)
    low = position.long()
    fraction = position - low
    high = (low + 1).clamp(max=source - 1)
    grid = torch.arange(source, device=start.device)
    weights = (grid == low[..., None]) * (1 - fraction)[..., None] + (grid == high[..., None]) * (
        fraction[..., None]
    )
    return weights * inside[..., None]


_BUILDERS = ("fasterrcnn_", "maskrcnn_")  # the prefixes of torchvision's builders
# Spread of the calibrated box classifier's logits: with 91 classes, about 100 (proposal,
# class) pairs of a photograph then score over 0.05, as a trained model's on a busy image.
_CLASS_LOGIT_STD = 2.0


def build_rcnn(
    variant: str = "fasterrcnn_resnet50_fpn",
    image_size: tuple[int, int] = (480, 640),
    realistic_load: bool = True,
    num_classes: int = 91,
    seed: int = 0,
    **settings,
) -> nn.Module:
    """A seeded random-weight torchvision Faster or Mask R-CNN in eval mode whose
    transform keeps ``image_size`` as is; with ``realistic_load`` its batch norms are
    fitted to real photographs and its objectness and class logits spread as a trained
    model's, so that proposals and detections are many and varied. ``settings`` go to
    the torchvision builder (``rpn_post_nms_top_n_test=...``)."""
    from torchvision.models import detection, list_models

    # Every Faster and Mask R-CNN builder torchvision has (the keypoint one has no family).
    variants = [name for name in list_models(detection) if name.startswith(_BUILDERS)]
    if variant not in variants:
        raise ValueError(f"variant must be one of {', '.join(variants)}; got {variant!r}")
    height, width = steps.check_image_size(image_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(detection, variant)(
            weights=None,
            weights_backbone=None,
            num_classes=num_classes,
            min_size=min(height, width),
            max_size=max(height, width),
            **settings,
        )
    model.eval()
    if realistic_load:
        calibrate_rcnn(model, (height, width))
    return model


@torch.no_grad()
def calibrate_rcnn(model: nn.Module, image_size: tuple[int, int]) -> None:
    """Batch norms fitted to photographs; the objectness spread with
    ``calibration.LOGIT_STD`` and the box classifier's logits with 2 (random ones
    score every anchor and class alike)."""
    pipeline = FasterRCNNPipeline(model, image_size)
    photos = calibration.photos(image_size)
    calibration.fit_batch_norms(model, lambda: pipeline(photos))
    objectness = model.rpn.head.cls_logits
    objectness.bias.zero_()
    raw = torch.cat(
        [o.flatten() for o in model.rpn.head(list(pipeline.features(photos).values()))[0]]
    )
    objectness.weight.mul_(calibration.LOGIT_STD / raw.std().clamp_min(1e-12))
    classifier = model.roi_heads.box_predictor.cls_score
    classifier.bias.zero_()
    features = pipeline.features(photos)
    pooled = pipeline.pool("box_roi_pool", features, pipeline.proposals(features)[0])
    logits = model.roi_heads.box_predictor(model.roi_heads.box_head(pooled))[0]
    classifier.weight.mul_(_CLASS_LOGIT_STD / logits.std().clamp_min(1e-12))


def _box_only(model) -> bool:
    """A Faster R-CNN without mask or keypoint heads (both subclass FasterRCNN)."""
    from torchvision.models.detection import FasterRCNN

    heads = getattr(model, "roi_heads", None)
    return (
        isinstance(model, FasterRCNN)
        and getattr(heads, "mask_predictor", None) is None
        and getattr(heads, "keypoint_predictor", None) is None
    )


class FasterRCNNFamily(DetectionFamily):
    """torchvision's Faster R-CNN: ``FasterRCNNPipeline``."""

    name = "faster_rcnn"

    def detects(self, model) -> bool:
        return _box_only(model)

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        return FasterRCNNPipeline(model, image_size)

    def load_note(self, pipeline: nn.Module, batch: torch.Tensor) -> str:
        return steps.detections_note("Faster R-CNN", pipeline, batch, "build_rcnn")


class MaskRCNNFamily(DetectionFamily):
    """torchvision's Mask R-CNN: ``MaskRCNNPipeline``; the user's dicts have masks
    [N, 1, H, W] too, which comparisons judge on the matched detections."""

    name = "mask_rcnn"
    output_names = MASK_OUTPUTS

    def detects(self, model) -> bool:
        from torchvision.models.detection import MaskRCNN

        return isinstance(model, MaskRCNN) and model.roi_heads.keypoint_predictor is None

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        return MaskRCNNPipeline(model, image_size)

    def to_user(self, outputs: tuple) -> list[dict[str, torch.Tensor]]:
        detections = super().to_user(outputs)
        for i, image in enumerate(detections):
            image["masks"] = outputs[4][i, : len(image["scores"])].float()
        return detections

    def load_note(self, pipeline: nn.Module, batch: torch.Tensor) -> str:
        return steps.detections_note("Mask R-CNN", pipeline, batch, "build_rcnn")


FASTER_RCNN = FasterRCNNFamily()
MASK_RCNN = MaskRCNNFamily()
