"""Fixed-shape steps shared by the torchvision detector pipelines (RetinaNet, FCOS, SSD,
R-CNN): the preprocessing (``StaticTransform``), the anchors, the one-stage pipelines'
common part (``OneStagePipeline``) and the post-processing steps.

torchvision post-processes each image in a Python loop, keeping what passes a threshold
(``scores[keep]``), so sizes depend on the data and the host waits on the device. Here
every step keeps all slots and marks the discarded ones as padding instead (box 0,
score 0, label -1), which ``torch.ops.bladesmith.batched_nms`` ignores: shapes depend
on the image size and the model's settings only, so a pipeline compiles, exports and
captures in one CUDA graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.errors import quiet_log
from bladesmith.ops import load_library


def check_image_size(image_size) -> tuple[int, int]:
    try:
        height, width = (int(s) for s in image_size)
    except (TypeError, ValueError):
        raise ValueError(f"image_size: expected (height, width), got {image_size!r}") from None
    if height <= 0 or width <= 0:
        raise ValueError(f"image_size: expected positive (height, width), got {image_size!r}")
    return height, width


class KeepsFloat32(nn.Module):
    """A module whose buffers named in ``float32_buffers`` stay float32 when it is cast to
    16 bits: post-processing runs in float32, and 16-bit anchors would shift boxes."""

    float32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.float32_buffers}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            setattr(self, name, value.to(getattr(self, name).device))
        return self


class StaticTransform(KeepsFloat32):
    """``GeneralizedRCNNTransform`` in eval mode for one image size: normalise, resize
    (to ``fixed_size`` or by torchvision's min/max-size rule, decided once) and pad to the
    size divisor; ``to_image`` scales boxes back as ``transform.postprocess`` does."""

    float32_buffers = ("box_scale",)

    def __init__(self, transform: nn.Module, image_size: tuple[int, int]):
        super().__init__()
        height, width = check_image_size(image_size)
        self.image_size = (height, width)
        if transform.fixed_size is not None:  # torchvision's fixed_size is (width, height)
            self.resized_size = (int(transform.fixed_size[1]), int(transform.fixed_size[0]))
        else:
            scale = min(
                transform.min_size[-1] / min(height, width),
                transform.max_size / max(height, width),
            )
            self.resized_size = (int(math.floor(height * scale)), int(math.floor(width * scale)))
        divisor = transform.size_divisible
        self.padded_size = tuple(int(math.ceil(s / divisor) * divisor) for s in self.resized_size)
        self.register_buffer(
            "image_mean", torch.tensor(transform.image_mean).view(1, 3, 1, 1), persistent=False
        )
        self.register_buffer(
            "image_std", torch.tensor(transform.image_std).view(1, 3, 1, 1), persistent=False
        )
        # torchvision's resize_boxes divides float32 sizes: the same rounding here.
        ratios = [
            torch.tensor(float(s), dtype=torch.float32)
            / torch.tensor(float(r), dtype=torch.float32)
            for s, r in zip(self.image_size, self.resized_size)
        ]
        ratio_h, ratio_w = ratios
        self.register_buffer(
            "box_scale", torch.stack([ratio_w, ratio_h, ratio_w, ratio_h]), persistent=False
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # The tracer (ONNX export) would warn on this Python check and record nothing.
        if not torch.jit.is_tracing() and (
            images.dim() != 4 or images.shape[1] != 3 or tuple(images.shape[-2:]) != self.image_size
        ):
            raise ValueError(
                f"images: expected a tensor [B, 3, {self.image_size[0]}, {self.image_size[1]}] "
                f"(the size this pipeline was built for), got shape {tuple(images.shape)}"
            )
        x = (images - self.image_mean.to(images.dtype)) / self.image_std.to(images.dtype)
        if self.resized_size != self.image_size:
            x = F.interpolate(x, size=self.resized_size, mode="bilinear", align_corners=False)
        pad_h = self.padded_size[0] - self.resized_size[0]
        pad_w = self.padded_size[1] - self.resized_size[1]
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        return x

    def to_image(self, boxes: torch.Tensor) -> torch.Tensor:
        """Boxes [..., 4] from resized to input image coordinates."""
        return boxes if self.resized_size == self.image_size else boxes * self.box_scale


def backbone_features(backbone: nn.Module, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """The feature maps of ``backbone`` by level name. A backbone may return one tensor
    (torchvision's FasterRCNN example: MobileNetV2's features, no FPN): it is level "0",
    as torchvision's detectors name it."""
    features = backbone(images)
    return {"0": features} if isinstance(features, torch.Tensor) else features


@torch.no_grad()
def static_anchors(model, padded_size, resized_size):
    """Anchors [N, 4], the feature-map size (height, width) of each level by name and
    the anchors per level, for one padded input size (``model`` has ``backbone``,
    ``anchor_generator`` and ``parameters``).

    The feature-map sizes come from running the backbone on fake tensors (no compute,
    any backbone); anchors from the model's own anchor generator.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchvision.models.detection.image_list import ImageList

    parameter = next(model.parameters())
    # An operator failing on fake tensors is logged with its traceback, then raised.
    with quiet_log("torch._subclasses.fake_tensor"), FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.empty(1, 3, *padded_size, device=parameter.device, dtype=parameter.dtype)
        features = backbone_features(model.backbone, fake)
        grid_sizes = {name: tuple(f.shape[-2:]) for name, f in features.items()}
    images = ImageList(torch.empty(1, 3, *padded_size), [tuple(resized_size)])
    feature_maps = [torch.empty(1, 1, h, w) for h, w in grid_sizes.values()]
    anchors = model.anchor_generator(images, feature_maps)[0]
    per_location = model.anchor_generator.num_anchors_per_location()
    level_sizes = [h * w * a for (h, w), a in zip(grid_sizes.values(), per_location)]
    return anchors.to(parameter.device), grid_sizes, level_sizes


class OneStagePipeline(KeepsFloat32):
    """What torchvision's one-stage detectors (RetinaNet, FCOS, SSD) share for one fixed
    image size: the preprocessing, the model's backbone, head and box coder (shared, not
    modified), the static anchors and the post-processing settings. Subclasses add
    ``forward``."""

    float32_buffers = ("anchors",)

    def __init__(self, model: nn.Module, image_size: tuple[int, int], kind: type, name: str):
        super().__init__()
        eval_model(model, kind, name)
        load_library()  # forward calls torch.ops.bladesmith
        self.transform = StaticTransform(model.transform, image_size)
        self.backbone = model.backbone
        self.head = model.head
        self.box_coder = model.box_coder
        self.score_threshold = float(model.score_thresh)
        self.topk_candidates = int(model.topk_candidates)
        self.iou_threshold = float(model.nms_thresh)
        self.max_detections = int(model.detections_per_img)
        anchors, grid_sizes, self.level_sizes = static_anchors(
            model, self.transform.padded_size, self.transform.resized_size
        )
        self.grid_sizes = list(grid_sizes.values())
        self.register_buffer("anchors", anchors, persistent=False)
        self.eval()  # an exporter restores the mode it found, on every submodule

    def features(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The backbone's feature maps of ``images`` [B, 3, H, W], level by level."""
        return list(backbone_features(self.backbone, self.transform(images)).values())


def top_per_level(
    scores: torch.Tensor,
    level_sizes: list[int],
    num_classes: int,
    k: int,
    threshold: float,
    *,
    strict: bool = True,
):
    """Per image and level, the ``k`` best of ``scores`` [B, N, C] that pass ``threshold``
    (``>``, or ``>=`` when not ``strict``; NaN never passes), as torchvision keeps
    ``scores[scores > t].topk(min(k, count))`` level by level.

    Returns (scores [B, K], anchor index [B, K] into N, class [B, K], valid [B, K]) with
    K = sum over levels of min(k, N_l * C); invalid slots hold what did not pass.
    """
    out_scores, anchors, classes, valid = [], [], [], []
    start = 0
    for size in level_sizes:
        flat = scores[:, start : start + size].flatten(1)
        passing = flat > threshold if strict else flat >= threshold
        count = min(k, size * num_classes)
        best, index = flat.masked_fill(~passing, -math.inf).topk(count, dim=1)
        out_scores.append(best)
        anchors.append(torch.div(index, num_classes, rounding_mode="floor") + start)
        classes.append(index % num_classes)
        valid.append(passing.gather(1, index))
        start += size
    return tuple(torch.cat(parts, dim=1) for parts in (out_scores, anchors, classes, valid))


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` [B, N, W] (or [N, W], shared by the batch) at ``index`` [B, K]: [B, K, W]."""
    if x.dim() == 2:
        return x[index]
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def decode_boxes(box_coder, deltas: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """torchvision ``BoxCoder.decode_single`` on [..., 4] deltas and anchors (any batch
    shape): the same arithmetic, so the same boxes to the bit."""
    shape = deltas.shape
    return decode_single(box_coder, deltas.reshape(-1, 4), anchors.reshape(-1, 4)).view(shape)


def decode_single(box_coder, rel_codes: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """torchvision's ``BoxCoder.decode_single(rel_codes [N, 4K], boxes [N, 4])``, step for
    step, but with its corner offset's 0.5 as a number: torchvision makes it a tensor on
    the boxes' device, which on a GPU is a copy from the host that synchronises, so no
    CUDA graph could hold the decode (0.5 times a float is exact either way)."""
    boxes = boxes.to(rel_codes.dtype)
    widths = boxes[:, 2] - boxes[:, 0]
    heights = boxes[:, 3] - boxes[:, 1]
    ctr_x = boxes[:, 0] + 0.5 * widths
    ctr_y = boxes[:, 1] + 0.5 * heights
    wx, wy, ww, wh = box_coder.weights
    dx = rel_codes[:, 0::4] / wx
    dy = rel_codes[:, 1::4] / wy
    dw = torch.clamp(rel_codes[:, 2::4] / ww, max=box_coder.bbox_xform_clip)
    dh = torch.clamp(rel_codes[:, 3::4] / wh, max=box_coder.bbox_xform_clip)
    pred_ctr_x = dx * widths[:, None] + ctr_x[:, None]
    pred_ctr_y = dy * heights[:, None] + ctr_y[:, None]
    pred_w = torch.exp(dw) * widths[:, None]
    pred_h = torch.exp(dh) * heights[:, None]
    c_to_c_h = 0.5 * pred_h
    c_to_c_w = 0.5 * pred_w
    corners = (
        pred_ctr_x - c_to_c_w,
        pred_ctr_y - c_to_c_h,
        pred_ctr_x + c_to_c_w,
        pred_ctr_y + c_to_c_h,
    )
    return torch.stack(corners, dim=2).flatten(1)


def clip_boxes(boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's ``clip_boxes_to_image`` for a static (height, width)."""
    height, width = size
    x = boxes[..., 0::2].clamp(min=0, max=width)
    y = boxes[..., 1::2].clamp(min=0, max=height)
    return torch.stack((x, y), dim=-1).reshape(boxes.shape)


def as_padding(boxes, scores, labels, valid):
    """Invalid slots become padding (box 0, score 0, label -1)."""
    return (
        boxes.masked_fill(~valid[..., None], 0.0),
        scores.masked_fill(~valid, 0.0),
        labels.masked_fill(~valid, -1),
    )


def not_small(boxes: torch.Tensor, min_size: float) -> torch.Tensor:
    """torchvision's ``remove_small_boxes`` as a mask: width and height >= ``min_size``."""
    widths = boxes[..., 2] - boxes[..., 0]
    heights = boxes[..., 3] - boxes[..., 1]
    return (widths >= min_size) & (heights >= min_size)


def batched_nms(boxes, scores, labels, iou_threshold: float, max_detections: int):
    """``torch.ops.bladesmith.batched_nms``: padded (boxes, scores, labels, counts)."""
    return torch.ops.bladesmith.batched_nms(
        boxes, scores, labels, float(iou_threshold), int(max_detections)
    )


def eval_model(model: nn.Module, kind: type, name: str) -> None:
    """TypeError unless ``model`` is a ``kind``, ValueError unless in eval mode."""
    if not isinstance(model, kind):
        raise TypeError(f"model: expected a torchvision {name}, got {type(model).__name__}")
    if model.training:
        raise ValueError("model: expected a model in eval mode (call model.eval() first)")


@torch.no_grad()
def detections_note(name: str, pipeline: nn.Module, batch: torch.Tensor, builder: str) -> str:
    """A report line: how many detections each image of ``batch`` keeps, and whether
    post-processing is then timed (and compared) under a real load."""
    counts = pipeline(batch)[3].tolist()
    capacity = pipeline.max_detections
    if min(counts) == 0:
        verdict = (
            "an image has none: post-processing is timed without load and the comparison "
            f"sees nothing there (random weights? {builder}(realistic_load=True) calibrates "
            "them)"
        )
    elif min(counts) < capacity // 2:
        verdict = "a lighter load than a trained model's on a busy image"
    else:
        verdict = "post-processing is timed under realistic load"
    return f"{name} detections per image: {counts} (at most {capacity}); {verdict}"


def resnet18_p3_p7_body():
    """A random ResNet-18 with the FPN torchvision's RetinaNet and FCOS put on ResNet-50
    (levels P3-P7, 256 channels): the small backbone of both families' ``resnet18``."""
    from torchvision.models import resnet18
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    return _resnet_fpn_extractor(
        resnet18(), 5, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256)
    )
