"""What the serving tests share: the tiny net and its reference weights, models taking
other dtypes than float32, a model calling the user's operator, a tiny Mask R-CNN, free
loopback ports."""

from __future__ import annotations

import socket

import torch
from torch import nn

import bladesmith
from bladesmith.config import Config

QUICK = Config(warmup=0, iters=1)
NET_BATCH = 4


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (bound together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for each in sockets:
            each.bind(("127.0.0.1", 0))
        return [each.getsockname()[1] for each in sockets]
    finally:
        for each in sockets:
            each.close()


class TinyNet(nn.Module):
    """Two outputs of different dtypes and ranks: scores [B, 5] and the argmax [B]."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
        )

    def forward(self, x):
        scores = self.body(x)
        return scores, scores.argmax(dim=1)


def tiny_net() -> TinyNet:
    """The same weights every time: the reference the served answers are checked against."""
    torch.manual_seed(0)
    return TinyNet().eval()


def optimized_net():
    x = torch.randn(NET_BATCH, 3, 8, 8)
    optimized, _, _ = bladesmith.optimize(
        tiny_net(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    return optimized


class ScaleClips(nn.Module):
    """A linear layer, then the user's operator (tests/conftest.py's ``user_library``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 4)

    def forward(self, x):
        return torch.ops.userops_test.scale_clip(self.linear(x), 2.0, 1.5)


VOCABULARY = 50


class Tagger(nn.Module):
    """Token ids (int64) and a float mask [B, T] in: the masked mean of the ids' embeddings
    through a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCABULARY, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids, mask):
        pooled = (self.embedding(ids) * mask.unsqueeze(-1)).sum(1)
        return self.head(pooled / mask.sum(1, keepdim=True).clamp(min=1))


class LastStep(nn.Module):
    """A float64 sequence [B, T, F] and each row's length (int64 [B]) in: the row's last
    step through a float64 linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(5, 2).double()

    def forward(self, x, lengths):
        steps = (lengths - 1).view(-1, 1, 1).expand(-1, 1, x.size(2))
        return self.linear(x.gather(1, steps).squeeze(1))


def typed_inputs(model: nn.Module, rows: int = NET_BATCH, seed: int = 0) -> tuple:
    """Inputs of ``Tagger`` or ``LastStep``: ids within the vocabulary and a 0/1 mask, or
    a float64 sequence and lengths within it."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, Tagger):
        ids = torch.randint(0, VOCABULARY, (rows, 7), generator=generator)
        mask = (torch.rand(rows, 7, generator=generator) > 0.3).float()
        return ids, mask
    x = torch.randn(rows, 6, 5, generator=generator, dtype=torch.float64)
    return x, torch.randint(1, 7, (rows,), generator=generator)


class Spin(nn.Module):
    """Rounds of a matrix product, as many as the batch's largest ``steps`` (int64, one
    per row): how long a request takes is its own to say. Rows [B, 16] in, [B, 256] out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(256, 256) / 16)

    def forward(self, x, steps):
        state = x.repeat(1, 16).unsqueeze(1).expand(-1, 64, -1)
        for _ in range(int(steps.max())):
            state = torch.tanh(state @ self.weight + 1)  # kept from denormals: they are slow
        return state.mean(1)


MASK_SIZE = (128, 160)


def tiny_mask_rcnn() -> nn.Module:
    """A torchvision Mask R-CNN small enough for a CPU (a 3-layer backbone, 32-channel
    heads, 20 detections of 3 classes), with detections as many and varied as a trained
    model's (``calibrate_rcnn``)."""
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    from bladesmith.families.rcnn import calibrate_rcnn

    torch.manual_seed(0)
    layers = []
    for channels_in, channels in ((3, 16), (16, 32), (32, 32)):
        layers += [nn.Conv2d(channels_in, channels, 3, 2, 1), nn.BatchNorm2d(channels), nn.ReLU()]
    backbone = nn.Sequential(*layers)
    backbone.out_channels = 32
    model = MaskRCNN(
        backbone,
        num_classes=None,  # the predictors say it
        rpn_anchor_generator=AnchorGenerator(((16, 32, 64),), ((0.5, 1.0, 2.0),)),
        box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2),
        box_head=TwoMLPHead(32 * 7 * 7, 64),
        box_predictor=FastRCNNPredictor(64, 4),
        mask_roi_pool=MultiScaleRoIAlign(["0"], 14, 2),
        mask_head=MaskRCNNHeads(32, (32, 32), 1),
        mask_predictor=MaskRCNNPredictor(32, 32, 4),
        min_size=min(MASK_SIZE),
        max_size=max(MASK_SIZE),
        rpn_pre_nms_top_n_test=200,
        rpn_post_nms_top_n_test=100,
        box_detections_per_img=20,
    ).eval()
    calibrate_rcnn(model, MASK_SIZE)
    return model
