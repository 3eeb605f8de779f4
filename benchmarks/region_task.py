"""A classification task a random-weight torchvision classifier can be trained on here in
seconds, so that agreement with it means something: which region of which photograph a
view shows.

Weights cannot be downloaded here, and a classifier with random weights answers noise
(logits about 1e-11 apart, every photograph in one or two classes), on which top-1
agreement cannot tell a right quantized result from a wrong one. This module gives one a
task: each of the bundled photographs is cut into a grid of regions (5 photographs x 3 x 3
= 45 classes); a view is a crop around a region's centre, moved and scaled at random. The
model's batch norms are first re-estimated on photographs (their running statistics are
those of the random initialisation, not of its activations), then its last linear layer
is replaced by one trained on the backbone's features of ``--train`` views (logistic
regression). The backbone's weights stay random; the head is trained; views drawn with
another seed are held out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.images import _VIEWED, photo

GRID = 3


def views(count: int, size: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` views [count, 3, H, W] and their classes (region index), regions in turn."""
    generator = torch.Generator().manual_seed(seed)
    photos = [photo(name) for name in _VIEWED]
    images, labels = [], []
    for i in range(count):
        label = i % (len(photos) * GRID * GRID)
        source = photos[label // (GRID * GRID)]
        row, column = divmod(label % (GRID * GRID), GRID)
        height, width = source.shape[1] / GRID, source.shape[2] / GRID
        jitter = (torch.rand(3, generator=generator) - 0.5).tolist()
        scale = 1.0 + 0.3 * jitter[2]  # the crop's size over the region's
        centre = ((row + 0.5 + 0.3 * jitter[0]) * height, (column + 0.5 + 0.3 * jitter[1]) * width)
        half = (scale * height / 2, scale * width / 2)
        top = int(max(0, min(source.shape[1] - 2 * half[0], centre[0] - half[0])))
        left = int(max(0, min(source.shape[2] - 2 * half[1], centre[1] - half[1])))
        crop = source[:, top : top + int(2 * half[0]), left : left + int(2 * half[1])]
        images.append(F.interpolate(crop[None], size=size, mode="bilinear", antialias=True)[0])
        labels.append(label)
    return torch.stack(images).clamp_(0.0, 1.0), torch.tensor(labels)


def _head(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the last linear layer, and that layer's attribute name."""
    for holder in (model, getattr(model, "classifier", None), getattr(model, "heads", None)):
        if holder is None:
            continue
        names = [name for name, child in holder.named_children() if isinstance(child, nn.Linear)]
        if names:
            return holder, names[-1]
    raise ValueError(f"{type(model).__name__}: no last nn.Linear found")


@torch.no_grad()
def recalibrate_norms(model: nn.Module, images: torch.Tensor, batch: int = 8) -> None:
    """Re-estimate every batch norm's running statistics on ``images`` (their average)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over the batches
    model.train()
    for i in range(0, len(images), batch):
        model(images[i : i + batch])
    model.eval()


def trained(model: nn.Module, size=(224, 224), train: int = 360, seed: int = 1) -> float:
    """Give ``model`` (in place) re-estimated norms and a head trained on ``train`` views;
    its accuracy on them."""
    model.eval()
    recalibrate_norms(model, views(64, size, seed=seed + 1000)[0])
    holder, name = _head(model)
    old = getattr(holder, name)
    setattr(holder, name, nn.Identity())
    images, labels = views(train, size, seed=seed)
    with torch.no_grad():
        features = torch.cat([model(images[i : i + 8]) for i in range(0, len(images), 8)])
    mean, std = features.mean(0), features.std(0) + 1e-6
    head = nn.Linear(features.shape[1], int(labels.max()) + 1)
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=200, line_search_fn="strong_wolfe")
    normalized = (features - mean) / std

    def loss():
        optimizer.zero_grad()
        value = F.cross_entropy(head(normalized), labels) + 1e-3 * head.weight.square().sum()
        value.backward()
        return value

    optimizer.step(loss)
    # The normalization folded into the layer: one nn.Linear, as the model had.
    new = nn.Linear(features.shape[1], head.out_features, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(head.weight / std)
        new.bias.copy_(head.bias - (head.weight * mean / std).sum(1))
        accuracy = float((head(normalized).argmax(1) == labels).float().mean())
    setattr(holder, name, new)
    return accuracy
