"""The RetinaNet family: torchvision's RetinaNet as a fixed-shape pipeline, with
bladesmith's post-processing.

torchvision's eager RetinaNet resizes and batches images in Python, computes anchors on
every call, and post-processes with data-dependent sizes and host synchronisations. For
one fixed image size all of that is static: ``RetinaNetPipeline`` does the same
arithmetic with static shapes (anchors computed once, the resize and padding decided at
construction) and calls ``torch.ops.bladesmith.retinanet_postprocess``, so the whole
model, image to padded detections, compiles without graph breaks, exports, and can be
captured in one CUDA graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.families.base import DetectionFamily
from bladesmith.families.retinanet_head import PackedRetinaNetHead, packing_problem
from bladesmith.ops import load_library

_FLOAT32_BUFFERS = ("anchors", "box_scale")
# A trained RetinaNet on a busy image keeps more than this many candidates per level
# over the score threshold; fewer means post-processing is timed under a light load.
REALISTIC_CANDIDATES = 1000


class RetinaNetPipeline(nn.Module):
    """A torchvision RetinaNet for one fixed image size, with padded outputs.

    ``forward(images[B, 3, H, W] float in [0, 1]) -> (boxes[B, D, 4], scores[B, D],
    labels[B, D] int64, num_detections[B] int64)``, D = ``model.detections_per_img``,
    gives the detections of ``model(list(images))``; slots past ``num_detections`` are
    padding (box 0, score 0, label -1). Boxes and scores are float32 whatever dtype the
    network runs in.

    The pipeline shares ``model``'s backbone and head (it modifies neither): convert a
    copy, not the user's model, to another dtype or device.
    """

    def __init__(self, model: nn.Module, image_size: tuple[int, int]):
        super().__init__()
        _check_retinanet(model)
        height, width = check_image_size(image_size)
        load_library()  # forward calls torch.ops.bladesmith
        transform = model.transform
        self.backbone = model.backbone
        self.head = model.head
        self.image_size = (height, width)
        self.score_threshold = float(model.score_thresh)
        self.topk_candidates = int(model.topk_candidates)
        self.iou_threshold = float(model.nms_thresh)
        self.max_detections = int(model.detections_per_img)
        self.box_weights = [float(w) for w in model.box_coder.weights]
        self.bbox_clip = float(model.box_coder.bbox_xform_clip)

        # The transform's eval-mode resize: scale so the short side reaches min_size
        # unless the long side would pass max_size (torchvision's rule, decided once).
        scale = min(
            transform.min_size[-1] / min(height, width), transform.max_size / max(height, width)
        )
        self.resized_size = (int(math.floor(height * scale)), int(math.floor(width * scale)))
        divisor = transform.size_divisible
        self.padded_size = tuple(int(math.ceil(s / divisor) * divisor) for s in self.resized_size)
        mean = torch.tensor(transform.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(transform.image_std).view(1, 3, 1, 1)
        self.register_buffer("image_mean", mean, persistent=False)
        self.register_buffer("image_std", std, persistent=False)
        # Boxes come out in resized coordinates; torchvision scales them back by these.
        ratio_h = height / self.resized_size[0]
        ratio_w = width / self.resized_size[1]
        self.register_buffer(
            "box_scale", torch.tensor([ratio_w, ratio_h, ratio_w, ratio_h]), persistent=False
        )
        self.register_buffer(
            "resized_hw", torch.tensor([self.resized_size], dtype=torch.int64), persistent=False
        )
        anchors, self.grid_sizes, self.level_sizes = _static_anchors(
            model, self.padded_size, self.resized_size
        )
        self.register_buffer("anchors", anchors, persistent=False)

    def _apply(self, fn, recurse=True):
        # Casting the network to 16 bits moves these buffers but keeps them float32:
        # post-processing runs in float32, and 16-bit anchors would shift boxes.
        kept = {name: getattr(self, name) for name in _FLOAT32_BUFFERS}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            setattr(self, name, value.to(getattr(self, name).device))
        return self

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Normalise, resize and pad as the model's transform does, with static shapes."""
        # The tracer (ONNX export) would warn on this Python check and record nothing.
        if not torch.jit.is_tracing() and (
            images.dim() != 4 or images.shape[1] != 3 or tuple(images.shape[-2:]) != self.image_size
        ):
            raise ValueError(
                f"images: expected a tensor [B, 3, {self.image_size[0]}, {self.image_size[1]}] "
                f"(the size this pipeline was built for), got shape {tuple(images.shape)}"
            )
        mean = self.image_mean.to(images.dtype)
        std = self.image_std.to(images.dtype)
        x = (images - mean) / std
        if self.resized_size != self.image_size:
            x = F.interpolate(x, size=self.resized_size, mode="bilinear", align_corners=False)
        pad_h = self.padded_size[0] - self.resized_size[0]
        pad_w = self.padded_size[1] - self.resized_size[1]
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        return x

    def pack_head(self) -> None:
        """Run the head once over all levels packed into one canvas rather than once
        per level: ``head`` becomes a ``PackedRetinaNetHead`` over the same layers.
        ValueError for heads that cannot be packed."""
        self.head = PackedRetinaNetHead(self.head, self.grid_sizes).to(self.anchors.device)

    def packing_problem(self) -> str | None:
        """Why ``pack_head`` cannot run here, or None."""
        if isinstance(self.head, PackedRetinaNetHead):
            return "the head is already packed"
        problem = packing_problem(self.head)
        return None if problem is None else f"the head cannot be packed: {problem}"

    def head_outputs(
        self, images: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Classification logits [B, N, C] and box deltas [B, N, 4] for all levels, in
        ``dtype`` (default: the network's)."""
        features = list(self.backbone(self.preprocess(images)).values())
        if isinstance(self.head, PackedRetinaNetHead):
            return tuple(_as_dtype(x, dtype) for x in self.head(features))
        per_level = level_outputs(self.head, features)
        if per_level is None:  # a head of its own kind: its forward concatenates
            head = self.head
            per_level = [head.classification_head(features)], [head.regression_head(features)]
        return tuple(concat_levels(levels, dtype) for levels in per_level)

    def forward(self, images: torch.Tensor):
        # Post-processing runs in float32 whatever the network's dtype: rounding scores
        # and coordinates to 16 bits reorders near-equal candidates and moves boxes by
        # up to half a pixel, and the cast is cheap (each level converts as it is copied
        # into the concatenation).
        cls_logits, bbox_deltas = self.head_outputs(images, torch.float32)
        boxes, scores, labels, num_detections = torch.ops.bladesmith.retinanet_postprocess(
            cls_logits,
            bbox_deltas,
            self.anchors,
            self.level_sizes,
            self.resized_hw.expand(images.shape[0], 2),
            self.score_threshold,
            self.topk_candidates,
            self.iou_threshold,
            self.max_detections,
            self.box_weights,
            self.bbox_clip,
        )
        if self.resized_size != self.image_size:
            boxes = boxes * self.box_scale
        return boxes, scores, labels, num_detections

    @torch.no_grad()
    def candidates_per_level(self, images: torch.Tensor) -> list[int]:
        """The fewest candidates over the score threshold on each level, over the batch:
        how much work post-processing gets (a trained model on a busy image: > 1,000)."""
        cls_logits, _ = self.head_outputs(images)
        passing = cls_logits.float().sigmoid() > self.score_threshold
        return [
            int(level.flatten(1).sum(1).min().item())
            for level in passing.split(self.level_sizes, dim=1)
        ]


def level_outputs(head: nn.Module, features: list[torch.Tensor]):
    """torchvision's RetinaNetHead on each level, without its concatenation: (logits
    [B, N_l, C] per level, deltas [B, N_l, 4] per level); None for a head whose
    classification or regression head has a forward of its own."""
    from torchvision.models.detection.retinanet import (
        RetinaNetClassificationHead,
        RetinaNetRegressionHead,
    )

    cls_head, reg_head = head.classification_head, head.regression_head
    if (
        type(cls_head).forward is not RetinaNetClassificationHead.forward
        or type(reg_head).forward is not RetinaNetRegressionHead.forward
    ):
        return None
    cls_logits = [
        _anchor_rows(cls_head.cls_logits(cls_head.conv(f)), cls_head.num_classes) for f in features
    ]
    bbox_deltas = [_anchor_rows(reg_head.bbox_reg(reg_head.conv(f)), 4) for f in features]
    return cls_logits, bbox_deltas


def _anchor_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, A * width, H, W] -> [B, H * W * A, width], as torchvision's heads reshape
    (a view when x is channels_last)."""
    batch, _, height, columns = x.shape
    return (
        x.view(batch, -1, width, height, columns).permute(0, 3, 4, 1, 2).reshape(batch, -1, width)
    )


def concat_levels(levels: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """The levels concatenated along dimension 1, each converted to ``dtype`` first.

    Each level goes in as two halves, so the concatenation has more than 8 inputs:
    Inductor lowers a concatenation of up to 8 inputs that need a copy into one kernel
    that tries a masked load from every input for each output element; with more, each
    input is converted straight into its slice of the output. On an H200 at batch 32
    the logits' concatenation took 1.22 ms one way and about 0.3 ms the other
    (benchmarks/bench_passes.py --profile).
    """
    if len(levels) == 1:
        return _as_dtype(levels[0], dtype)
    halves = [half for level in levels for half in level.tensor_split(2, dim=1)]
    return torch.cat([_as_dtype(half, dtype) for half in halves], dim=1)


def _as_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None else x.to(dtype)


def is_retinanet(model: object) -> bool:
    from torchvision.models.detection.retinanet import RetinaNet

    return isinstance(model, RetinaNet)


def _check_retinanet(model: nn.Module) -> None:
    if not is_retinanet(model):
        raise TypeError(
            f"model: expected a torchvision.models.detection.RetinaNet, got {type(model).__name__}"
        )
    if model.training:
        raise ValueError("model: expected a model in eval mode (call model.eval() first)")


def check_image_size(image_size) -> tuple[int, int]:
    try:
        height, width = (int(s) for s in image_size)
    except (TypeError, ValueError):
        raise ValueError(f"image_size: expected (height, width), got {image_size!r}") from None
    if height <= 0 or width <= 0:
        raise ValueError(f"image_size: expected positive (height, width), got {image_size!r}")
    return height, width


@torch.no_grad()
def _static_anchors(model: nn.Module, padded_size, resized_size):
    """Anchors [N, 4], the feature-map size (height, width) of each level and the
    anchors per level, for one padded input size.

    The feature-map sizes come from running the backbone on fake tensors (no compute,
    any backbone); anchors from the model's own anchor generator.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchvision.models.detection.image_list import ImageList

    parameter = next(model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.empty(1, 3, *padded_size, device=parameter.device, dtype=parameter.dtype)
        grid_sizes = [tuple(f.shape[-2:]) for f in model.backbone(fake).values()]
    images = ImageList(torch.empty(1, 3, *padded_size), [tuple(resized_size)])
    feature_maps = [torch.empty(1, 1, h, w) for h, w in grid_sizes]
    anchors = model.anchor_generator(images, feature_maps)[0]
    per_location = model.anchor_generator.num_anchors_per_location()
    level_sizes = [h * w * a for (h, w), a in zip(grid_sizes, per_location)]
    return anchors.to(parameter.device), grid_sizes, level_sizes


class RetinaNetFamily(DetectionFamily):
    """torchvision's RetinaNet: ``RetinaNetPipeline``, bladesmith's decode + NMS."""

    name = "retinanet"

    def detects(self, model) -> bool:
        return is_retinanet(model)

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        return RetinaNetPipeline(model, image_size)

    def load_note(self, pipeline: RetinaNetPipeline, batch: torch.Tensor) -> str:
        """Whether post-processing works as hard as for a trained model on a busy image:
        at least 1,000 candidates on each level (or all of a level's anchors x classes)."""
        per_level = pipeline.candidates_per_level(batch)
        num_classes = pipeline.head.classification_head.num_classes
        capacity = [size * num_classes for size in pipeline.level_sizes]
        counts = ", ".join(f"{n:,}" for n in per_level)
        if all(n >= min(REALISTIC_CANDIDATES, c) for n, c in zip(per_level, capacity)):
            verdict = (
                f"at least {REALISTIC_CANDIDATES:,} on every level (or all its anchors), a "
                "trained model's load on a busy image: post-processing is timed under "
                "realistic load"
            )
        else:
            verdict = (
                f"fewer than {REALISTIC_CANDIDATES:,} on some level: post-processing is timed "
                "under a lighter load than a trained model's on a busy image (random weights? "
                "build_retinanet(realistic_load=True) calibrates them)"
            )
        return f"RetinaNet candidates over the score threshold per level: {counts}; {verdict}"


FAMILY = RetinaNetFamily()
