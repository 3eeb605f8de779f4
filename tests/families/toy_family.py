"""A toy detector and its family, written as a user would write a new family: one module
with the model's fixed-shape pipeline and ``FAMILY``, plus one line that adds it to
``bladesmith.families.FAMILIES``."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.families.base import DetectionFamily

STRIDE = 4
SCORE_THRESHOLD = 0.5
MAX_DETECTIONS = 8


class ToyDetector(nn.Module):
    """Scores each 4x4 cell of an image for 3 classes; keeps the cells whose best score
    passes 0.5, at most 8, best first: a data-dependent number of detections per image,
    returned as torchvision's detectors do (a list of {boxes, scores, labels} dicts)."""

    def __init__(self):
        super().__init__()
        self.scorer = nn.Conv2d(3, 3, STRIDE, stride=STRIDE)

    def cells(self, batch: torch.Tensor):
        """(best score [B, N], its class [B, N], the cell's box [N, 4]) of each cell."""
        logits = self.scorer(batch)  # [B, 3, H/4, W/4]
        scores, labels = logits.sigmoid().flatten(2).max(dim=1)
        height, width = logits.shape[-2:]
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        corners = torch.stack([xs, ys, xs + 1, ys + 1], dim=-1).reshape(-1, 4)
        return scores, labels, (corners * STRIDE).to(batch.dtype)

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        scores, labels, boxes = self.cells(torch.stack(images))
        detections = []
        for image_scores, image_labels in zip(scores, labels):
            top, index = image_scores.topk(MAX_DETECTIONS)
            keep = top > SCORE_THRESHOLD  # host-side: how many is data-dependent
            index = index[keep]
            detections.append(
                {"boxes": boxes[index], "scores": top[keep], "labels": image_labels[index]}
            )
        return detections


class ToyPipeline(nn.Module):
    """The toy detector with fixed shapes: always 8 slots per image, padded."""

    def __init__(self, model: ToyDetector):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor):
        scores, labels, boxes = self.model.cells(images)
        top, index = scores.topk(MAX_DETECTIONS, dim=1)
        keep = top > SCORE_THRESHOLD
        count = keep.sum(dim=1)
        padded_boxes = torch.where(keep[..., None], boxes[index], torch.zeros_like(boxes[index]))
        padded_scores = torch.where(keep, top, torch.zeros_like(top))
        padded_labels = torch.where(keep, labels.gather(1, index), torch.full_like(index, -1))
        return padded_boxes, padded_scores, padded_labels, count


class ToyFamily(DetectionFamily):
    name = "toy"

    def detects(self, model) -> bool:
        return isinstance(model, ToyDetector)

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        return ToyPipeline(model)


FAMILY = ToyFamily()
