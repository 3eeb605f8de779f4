"""A realistic load for random-weight detectors.

A detector with random weights scores nothing over its threshold, so its post-processing
does no work and a comparison sees 0 detections on both sides. Calibrating one output
layer on real photographs (scale its weights to a trained model's spread of logits,
then shift its bias) makes every level keep as many candidates as a trained model on a
busy image.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bladesmith.images import sample_images

# Photographs the calibration looks at; the load holds on each of them.
CALIBRATION_PHOTOS = 3
# Spread of the calibrated logits: kept scores then spread as a trained model's do
# (RetinaNet's from about 0.8 to 0.96); a wider spread pushes them all to 0.999+, where
# float16 cannot tell them apart.
LOGIT_STD = 1.0


def logit(probability: float) -> float:
    return math.log(probability / (1.0 - probability))


def photos(image_size: tuple[int, int]) -> torch.Tensor:
    return sample_images(CALIBRATION_PHOTOS, image_size)


@torch.no_grad()
def calibrate(
    layer: nn.Module,
    raw: torch.Tensor,
    level_sizes: list[int],
    target_logit: float,
    candidates: int,
    *,
    margin: float = 0.25,
) -> None:
    """Scale ``layer`` (a convolution or linear layer whose bias was zero when ``raw``
    [B, N, C] was computed) so its outputs spread with ``LOGIT_STD``, and set its bias so
    that on every image and level at least ``candidates`` outputs (or all) exceed
    ``target_logit`` by ``margin``."""
    scale = LOGIT_STD / raw.std().clamp_min(1e-12)
    layer.weight.mul_(scale)
    raw = raw * scale
    kth_largest = min(
        level.flatten(1).topk(min(candidates, level[0].numel())).values[:, -1].min().item()
        for level in raw.split(level_sizes, dim=1)
        if level.shape[1]
    )
    layer.bias.fill_(target_logit - kth_largest + margin)


@torch.no_grad()
def fit_batch_norms(module: nn.Module, run) -> None:
    """Set the running statistics of ``module``'s batch norms to those ``run()`` (a
    forward pass over photographs) produces. With random weights and default statistics
    (mean 0, variance 1), deep networks such as MobileNetV3 shrink their activations to
    1e-14 and less; normalised, they keep a trained network's scale."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average: one pass sets the statistics
        norm.train()
    try:
        run()
    finally:
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
            norm.eval()
