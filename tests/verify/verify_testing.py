"""Detections made up for verify's tests: random lists, subsets, ranked images."""

from __future__ import annotations

import json

import torch


def strict_json(data) -> str:
    return json.dumps(data, allow_nan=False)


def make_detections(n=50, seed=0, num_classes=5):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 500
    wh = 20 + torch.rand(n, 2, generator=g) * 100
    return {
        "boxes": torch.cat([xy, xy + wh], dim=1),
        "scores": torch.rand(n, generator=g),
        "labels": torch.randint(0, num_classes, (n,), generator=g),
    }


def take(detections, index):
    return {key: value[index] for key, value in detections.items()}


def one_image(boxes, scores):
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32),
        "scores": torch.tensor(scores),
        "labels": torch.zeros(len(scores), dtype=torch.int64),
    }
