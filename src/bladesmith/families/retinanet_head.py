"""RetinaNet's head on every pyramid level at once, the levels packed into one canvas.

torchvision runs each of the head's ten convolutions once per level: fifty
convolutions, most too small to fill a GPU (at 480x640 the smallest level has 20
positions). The head's weights are shared by all levels, so the levels can lie side by
side in one feature map, a row or column of zeros between them, and each convolution
runs once over it. Zeroing the gaps again after every layer keeps the levels apart: a
3x3 convolution with zero padding then sees around each level exactly what it sees on
the level alone, so the outputs are the same numbers (up to the order of additions).
"""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.convs import is_same_size_3x3


def pack_levels(shapes: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Top-left corner (row, column) of each level and the canvas (height, width).

    Bottom-left skyline packing, in the order given, as wide as the widest level: each
    level goes where its top is highest, then leftmost. A row and a column of zeros stay
    free below and right of every level, so no two levels touch, diagonals included.
    """
    width = max(w for _, w in shapes)
    skyline = [0] * width  # per column: the first row a new level may use
    origins = []
    for height, level_width in shapes:
        top, left = min(
            (max(skyline[left : left + level_width + 1]), left)
            for left in range(width - level_width + 1)
        )
        origins.append((top, left))
        for column in range(left, min(left + level_width + 1, width)):
            skyline[column] = top + height + 1
    canvas_height = max(top + height for (top, _), (height, _) in zip(origins, shapes))
    return origins, (canvas_height, width)


def packable_blocks(tower: nn.Sequential) -> list[nn.Sequential] | None:
    """The blocks of a head tower when each is a 3x3, stride-1, zero-padded convolution
    followed by a ReLU; None for any other tower (a normalisation layer, as in RetinaNet
    v2, would mix statistics across the canvas)."""
    for block in tower:
        layers = list(block) if isinstance(block, nn.Sequential) else []
        if len(layers) != 2 or not is_same_size_3x3(layers[0]) or type(layers[1]) is not nn.ReLU:
            return None
    return list(tower)


def packing_problem(head: nn.Module) -> str | None:
    """Why ``PackedRetinaNetHead`` cannot run ``head`` (torchvision's RetinaNetHead), or None."""
    cls_head, reg_head = head.classification_head, head.regression_head
    if packable_blocks(cls_head.conv) is None or packable_blocks(reg_head.conv) is None:
        return (
            "its towers are not plain 3x3 convolutions + ReLU (normalisation layers would "
            "mix the levels of a packed canvas)"
        )
    if not (is_same_size_3x3(cls_head.cls_logits) and is_same_size_3x3(reg_head.bbox_reg)):
        return "its output layers are not 3x3 same-size convolutions"
    return None


class PackedRetinaNetHead(nn.Module):
    """``forward(features) -> (cls_logits [B, N, K], bbox_deltas [B, N, 4])``, equal to
    torchvision's ``head.classification_head(features)`` and
    ``head.regression_head(features)``, for features of the ``shapes`` given.

    It runs the head's own layers (shared, not copied): the towers' conv + ReLU blocks
    stay as they are, so passes that rewrite such blocks still find them.
    """

    def __init__(self, head: nn.Module, shapes: list[tuple[int, int]]):
        super().__init__()
        problem = packing_problem(head)
        if problem is not None:
            raise ValueError(f"cannot pack this RetinaNet head: {problem}")
        cls_head, reg_head = head.classification_head, head.regression_head
        self.cls_tower = nn.ModuleList(packable_blocks(cls_head.conv))
        self.reg_tower = nn.ModuleList(packable_blocks(reg_head.conv))
        self.cls_logits = cls_head.cls_logits
        self.bbox_reg = reg_head.bbox_reg
        self.num_classes = int(cls_head.num_classes)
        self.shapes = [(int(h), int(w)) for h, w in shapes]
        self.origins, self.canvas_size = pack_levels(self.shapes)
        mask = torch.zeros(1, 1, *self.canvas_size)
        positions = []
        canvas_width = self.canvas_size[1]
        for (top, left), (height, width) in zip(self.origins, self.shapes):
            mask[..., top : top + height, left : left + width] = 1
            rows = torch.arange(top, top + height).view(-1, 1)
            positions.append((rows * canvas_width + torch.arange(left, left + width)).flatten())
        # 1 on the levels, 0 in the gaps: a multiply zeroes the gaps after each layer.
        self.register_buffer("mask", mask, persistent=False)
        # Flat canvas index of every level position, in torchvision's order (level, row,
        # column): the outputs are gathered back into it.
        self.register_buffer("positions", torch.cat(positions), persistent=False)

    def forward(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        first = features[0]
        nhwc = first.is_contiguous(memory_format=torch.channels_last)
        canvas = torch.empty(
            (first.shape[0], first.shape[1], *self.canvas_size),
            dtype=first.dtype,
            device=first.device,
            memory_format=torch.channels_last if nhwc else torch.contiguous_format,
        ).zero_()
        for level, (top, left), (height, width) in zip(features, self.origins, self.shapes):
            canvas[:, :, top : top + height, left : left + width] = level
        cls_logits = self._gather(self.cls_logits(self._tower(self.cls_tower, canvas)))
        bbox_deltas = self._gather(self.bbox_reg(self._tower(self.reg_tower, canvas)))
        batch = first.shape[0]
        return cls_logits.reshape(batch, -1, self.num_classes), bbox_deltas.reshape(batch, -1, 4)

    def _tower(self, blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        mask = self.mask.to(x.dtype)
        for block in blocks:
            x = block(x) * mask
        return x

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] canvas -> [B, positions, C], positions in torchvision's order."""
        return x.flatten(2).transpose(1, 2).index_select(1, self.positions)
