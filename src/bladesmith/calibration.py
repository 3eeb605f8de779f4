"""The tolerance a float32 pass is judged at, measured on the model itself.

A float32 pass changes where sums round: another summation order, weights with a batch
norm folded in, another convolution algorithm. That moves the outputs by about what the
model's own rounding moves them, which grows with the outputs' magnitude and with the
sizes of the reductions (sqrt(K) x eps for a K-term dot product) through every layer; a
fixed atol fits no model (ResNet-50's logits move by 5e-5 under a fold, MobileNetV3's
random-weight outputs are 1e-9 in all). So it is measured: the model runs twice with each
weight moved by the rounding of the arithmetic it runs in (float32: one unit in the last
place, 2^-23 of itself; TF32 convolutions on a GPU: 2^-11), and a candidate may move each
output up to ``NOISE_MARGIN`` times as far as that does. A wrong pass (one convolution's
weights off by 1%) moves ResNet-50's logits about 1,000 times as far as rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from bladesmith.verify import ROUNDING_NOISE, Tolerance, is_detection_list, reference_under_noise

FLOAT32_NOISE = 2.0**-23  # float32's eps: a weight's last bit
NOISE_RUNS = 2
NOISE_MARGIN = 10.0


@dataclass(frozen=True)
class Calibration:
    """Tolerances per floating-point tensor output (keyed by its path, as
    ``compare_outputs`` names it), and how they were found."""

    tolerances: dict[str, Tolerance]
    rtol: float
    atol: float  # the largest of the per-output atols
    why: str

    def to_dict(self) -> dict:
        return {"rtol": self.rtol, "atol": self.atol, "why": self.why}


def rounding_unit(device: torch.device, model: torch.nn.Module) -> tuple[float, str]:
    """The relative rounding of the arithmetic ``model`` runs in on ``device``, and its
    name: TF32's when cuDNN may run its float32 convolutions (or matmuls) in TF32."""
    if device.type == "cuda":
        convolutions = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
        if (convolutions and torch.backends.cudnn.allow_tf32) or (
            torch.backends.cuda.matmul.allow_tf32
        ):
            return ROUNDING_NOISE, "TF32 (2^-11 of each)"
    return FLOAT32_NOISE, "float32 (2^-23 of each)"


def calibrate(
    model: torch.nn.Module,
    test_args: Sequence[tuple],
    reference,
    device: torch.device,
    rtol: float,
) -> Calibration | None:
    """Tolerances for ``reference`` (the model's outputs on ``test_args``) from the
    model's outputs under rounding noise; None when it has no floating-point tensor
    output (detections have their own comparison)."""
    outputs = {path: t for path, t in tensor_paths(reference) if t.is_floating_point()}
    if not outputs:
        return None
    unit, unit_name = rounding_unit(device, model)
    runs = [
        dict(tensor_paths(run))
        for run in reference_under_noise(model, test_args, runs=NOISE_RUNS, relative=unit)
    ]
    tolerances, largest_spread = {}, 0.0
    for path, tensor in outputs.items():
        spread = max(_max_abs(run[path] - tensor) for run in runs)
        largest_spread = max(largest_spread, spread)
        # Never below rounding at the output's own scale, for outputs noise left unmoved.
        floor = unit * _max_abs(tensor)
        tolerances[path] = Tolerance(rtol=rtol, atol=NOISE_MARGIN * max(spread, floor))
    atol = max(t.atol for t in tolerances.values())
    why = (
        f"float32 outputs within rtol {rtol:g} and atol {atol:.2g}: {NOISE_MARGIN:g} x the "
        f"most ({largest_spread:.2g}) that {NOISE_RUNS} runs of the model with its weights "
        f"moved by the rounding of {unit_name} moved them"
    )
    return Calibration(tolerances, rtol, atol, why)


def _max_abs(tensor: torch.Tensor) -> float:
    return float(tensor.detach().double().abs().max()) if tensor.numel() else 0.0


def tensor_paths(value, path: str = "out"):
    """(path, tensor) of every tensor in ``value``, named as ``compare_outputs`` names
    them; detection lists are left out."""
    if is_detection_list(value):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from tensor_paths(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensor_paths(item, f"{path}[{index}]")
    elif isinstance(value, torch.Tensor):
        yield path, value
