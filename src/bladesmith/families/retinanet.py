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

import torch
from torch import nn

from bladesmith.families import calibration
from bladesmith.families import detection_steps as steps
from bladesmith.families.base import DetectionFamily
from bladesmith.families.retinanet_head import PackedRetinaNetHead, packing_problem

# A trained RetinaNet on a busy image keeps more than this many candidates per level
# over the score threshold; fewer means post-processing is timed under a light load.
REALISTIC_CANDIDATES = 1000
# What build_retinanet calibrates random weights to: a little over that on every level.
_CALIBRATED_CANDIDATES = 1200


class RetinaNetPipeline(steps.OneStagePipeline):
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
        from torchvision.models.detection.retinanet import RetinaNet

        super().__init__(model, image_size, RetinaNet, "RetinaNet")
        self.box_weights = [float(w) for w in model.box_coder.weights]
        self.bbox_clip = float(model.box_coder.bbox_xform_clip)
        resized_hw = torch.tensor([self.transform.resized_size], dtype=torch.int64)
        self.register_buffer("resized_hw", resized_hw, persistent=False)

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
        features = self.features(images)
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
        return self.transform.to_image(boxes), scores, labels, num_detections

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
    halves = [half for level in levels for half in _halves(level)]
    return torch.cat([_as_dtype(half, dtype) for half in halves], dim=1)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.tensor_split(2, dim=1) as two slices: the ONNX exporter turns tensor_split into
    SplitToSequence/SequenceAt, which TensorRT does not implement, and slices into Slice."""
    first = (x.shape[1] + 1) // 2
    return x[:, :first], x[:, first:]


def _as_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None else x.to(dtype)


def is_retinanet(model: object) -> bool:
    from torchvision.models.detection.retinanet import RetinaNet

    return isinstance(model, RetinaNet)


# resnet50_v2: torchvision's retinanet_resnet50_fpn_v2 (GroupNorm in the heads, P6 from C5).
BACKBONES = ("resnet50", "resnet18", "resnet50_v2")


def build_retinanet(
    image_size: tuple[int, int] = (480, 640),
    realistic_load: bool = True,
    num_classes: int = 91,
    backbone: str = "resnet50",
    seed: int = 0,
) -> nn.Module:
    """A seeded random-weight torchvision RetinaNet in eval mode whose transform keeps
    ``image_size`` as is (nothing is downloaded). With ``realistic_load`` the
    classification layer is calibrated on real photographs so that at least 1,200
    candidates per level pass the score threshold, spread over a trained model's range
    of scores: post-processing then works as hard as for a trained model on a busy image.
    """
    from torchvision.models.detection import retinanet_resnet50_fpn, retinanet_resnet50_fpn_v2
    from torchvision.models.detection.retinanet import RetinaNet

    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {', '.join(BACKBONES)}; got {backbone!r}")
    height, width = steps.check_image_size(image_size)
    # min_size/max_size equal to the image's sides make the transform's resize a no-op.
    sizes = {"min_size": min(height, width), "max_size": max(height, width)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if backbone in ("resnet50", "resnet50_v2"):
            build = retinanet_resnet50_fpn if backbone == "resnet50" else retinanet_resnet50_fpn_v2
            model = build(weights=None, weights_backbone=None, num_classes=num_classes, **sizes)
        else:
            body = steps.resnet18_p3_p7_body()
            model = RetinaNet(body, num_classes, **sizes)
    model.eval()
    if realistic_load:
        calibrate_retinanet(model, (height, width))
    return model


@torch.no_grad()
def calibrate_retinanet(model: nn.Module, image_size: tuple[int, int]) -> None:
    """Scale and shift the classification layer of a random-weight RetinaNet so that
    every level keeps at least 1,200 candidates over the score threshold on real
    photographs, with logits spread like a trained model's."""
    pipeline = RetinaNetPipeline(model, image_size)
    cls_layer = model.head.classification_head.cls_logits
    cls_layer.bias.zero_()
    raw = pipeline.head_outputs(calibration.photos(image_size))[0]
    target = calibration.logit(model.score_thresh)
    calibration.calibrate(cls_layer, raw, pipeline.level_sizes, target, _CALIBRATED_CANDIDATES)


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
