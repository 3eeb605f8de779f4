"""The tolerance policy: how far an output may move, by dtype, and per output.

Tensors pass element by element at ``atol + rtol * |reference|``; the defaults below
are tuned for whole-model outputs after optimisation. Detection scores get a floor of
their own (``detection_score_tolerance``).

Float32 outputs get an atol measured on the model itself (``noise_tolerances``). A
float32 pass changes where sums round: another summation order, weights with a batch
norm folded in, another convolution algorithm. That moves the outputs by about what the
model's own rounding moves them, which grows with the outputs' magnitude and with the
reductions' sizes (sqrt(K) x eps for a K-term dot product) through every layer. So no
fixed atol fits every model: ResNet-50's logits (up to 50) move by 4e-5 under a fold,
past 1e-5; MobileNetV3's random-weight outputs are 1e-9 in all, under it. The model runs
twice with each weight moved by the rounding of the arithmetic it runs in (float32: one
unit in the last place, 2^-23 of itself; TF32 convolutions on a GPU: 2^-11), and a
candidate may move each output ``NOISE_MARGIN`` times as far as that did. A wrong pass
(one convolution's weights off by 1%) moves ResNet-50's logits 1,000 times as far as
rounding does, MobileNetV3's too.

Outputs computed in float16 or bfloat16 (the precision passes) are measured the same
way, with the weights moved by that type's rounding (``half_unit``) and a margin of
``HALF_NOISE_MARGIN``: a fixed tolerance rejected float16 for ResNet-50 whose logits
moved 0.03 in float16, where rounding its weights to float16 moves them 0.07.

However far rounding moves them, a 16-bit output is never allowed more than
``HALF_SPREAD_CEILING`` of its reference's spread (``spread_ceiling``): past that, the
type cannot tell the output's values apart and a tolerance would admit anything (an
output of magnitude 1e6 varying by 10 moves by thousands under bfloat16 rounding).
Integer and bool outputs are exact whatever tolerance is asked for, and a detector's
boxes are judged by the IoU rule (``verify.boxes``). Each tolerance says where it came
from (``Tolerance.source``), as the report prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Defaults by dtype, (rtol, atol). They are tuned for whole-model outputs after
# optimisation, not for single ops, so they are looser than torch.testing's:
# - float32: eps is 1.2e-7, but reordered reductions, fused kernels and another
#   convolution algorithm move a deep network's outputs by 1e-6..1e-5 relative; 1e-4
#   leaves room for that and still catches a wrong op (typically 1e-2 or more). TF32
#   matmuls (about 1e-3) fail on purpose: that precision change must be asked for.
# - float16: eps is 9.8e-4; rounding accumulates over the layers to a few eps, so
#   10 eps relative and 1 eps absolute. Polygraphy's users' first complaint is that its
#   1e-5 defaults fail every fp16 run.
# - bfloat16: eps is 7.8e-3 (8-bit mantissa); about 6 eps relative, 1e-2 absolute.
# - float64: torch.testing's, as nothing bladesmith does changes float64 arithmetic.
# - integers and bool (labels, counts, masks) must be equal.
_DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for outputs of ``dtype`` (see ``_DEFAULT_TOLERANCES`` for why).

    Complex dtypes use their real counterpart's. Other floating dtypes (float8) follow
    the float16 rule: ten eps relative, one eps absolute.
    """
    if dtype.is_complex:
        dtype = dtype.to_real()
    if dtype in _DEFAULT_TOLERANCES:
        return _DEFAULT_TOLERANCES[dtype]
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
        return (10 * eps, eps)
    return (0.0, 0.0)


@dataclass(frozen=True)
class Tolerance:
    """Override for one output; a field left None keeps the dtype's default.
    ``ceiling``: the most an element may move whatever rtol and atol give;
    ``source``: where these come from, in a few words."""

    rtol: float | None = None
    atol: float | None = None
    ceiling: float | None = None
    source: str | None = None


def is_exact(dtype: torch.dtype) -> bool:
    """Integer and bool outputs (labels, indices, counts, masks as bits) must be equal."""
    return not (dtype.is_floating_point or dtype.is_complex)


def exact_source(dtype: torch.dtype) -> str:
    return f"exact: {str(dtype).removeprefix('torch.')} outputs must be equal"


def is_half(dtype: torch.dtype | None) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


# The most a 16-bit output may move, as a fraction of its reference's range (max - min):
# ResNet-50's logits span 92 and move 0.26 in bfloat16, against an allowance of 2.3
# measured from rounding its weights; 5% (4.6) leaves that room and no more.
HALF_SPREAD_CEILING = 0.05


def spread_ceiling(reference, fraction: float = HALF_SPREAD_CEILING) -> tuple[float, str]:
    """``fraction`` of the range of ``reference``'s finite values (of their largest
    magnitude where all are equal: a single value has no range), and how it was got."""
    values = torch.as_tensor(reference).detach().double().flatten()
    values = values[torch.isfinite(values)]
    if not values.numel():
        return 0.0, "no finite value"
    spread = float(values.max() - values.min())
    if spread > 0:
        return fraction * spread, f"{fraction:.0%} of its range {spread:.3g}"
    magnitude = float(values.abs().max())
    return fraction * magnitude, f"{fraction:.0%} of its magnitude {magnitude:.3g} (no range)"


# Detection scores come out of a whole network, whose float32 convolutions run in TF32
# on recent NVIDIA GPUs (PyTorch's default for cuDNN), in the baseline too: another
# convolution algorithm (channels_last, a compiled kernel) moves them by ~1e-3.
_DETECTION_SCORE_ATOL_FLOOR = 5e-3


# Scores lie in [0, 1]: a tenth of that is the most rounding may move one (bfloat16's
# default is 0.06), whatever the other outputs are judged at.
DETECTION_SCORE_CEILING = 0.1


def detection_score_tolerance(dtype: torch.dtype, judged_at: float = 0.0) -> float:
    """How far a matched detection's score may move: rtol + atol of ``dtype`` (scores
    lie in [0, 1]), never less than 5e-3, nor than ``judged_at`` (the rtol + atol the
    other outputs are judged at), nor more than ``DETECTION_SCORE_CEILING``."""
    return detection_score_rule(dtype, judged_at)[0]


def detection_score_rule(dtype: torch.dtype, judged_at: float = 0.0) -> tuple[float, str]:
    """``detection_score_tolerance`` and where it comes from."""
    rtol, atol = default_tolerance(dtype)
    name = str(dtype).removeprefix("torch.")
    candidates = [
        (rtol + atol, f"{name} default rtol + atol"),
        (_DETECTION_SCORE_ATOL_FLOOR, "floor for TF32 convolutions"),
        (judged_at, "the other outputs' rtol + atol"),
    ]
    value, why = max(candidates, key=lambda each: each[0])
    if value > DETECTION_SCORE_CEILING:
        value, why = DETECTION_SCORE_CEILING, f"ceiling, a tenth of [0, 1] ({why} is more)"
    return value, f"scores within {value:.2g}: {why}"


FLOAT32_NOISE = 2.0**-23  # float32's eps: a weight's last bit
TF32_NOISE = 2.0**-11  # TF32's unit roundoff (10 mantissa bits)
NOISE_RUNS = 2
NOISE_MARGIN = 10.0
# A model run in float16 or bfloat16 moves its outputs about half as far as rounding its
# weights to that type does (ResNet-50: 0.03 against 0.07 in float16, 0.32 against 0.55
# in bfloat16; ViT-B/16 alike); 4 x leaves room for deeper models and still rejects one
# convolution 1% off in float16.
HALF_NOISE_MARGIN = 4.0


def half_unit(dtype: torch.dtype) -> float:
    """The unit roundoff of a 16-bit float type: 2^-11 for float16, 2^-8 for bfloat16."""
    return torch.finfo(dtype).eps / 2


def rounding_unit(
    device: torch.device, model: torch.nn.Module, dtype: torch.dtype = torch.float32
) -> tuple[float, str]:
    """The relative rounding of the ``dtype`` (float32 or float64) arithmetic ``model``
    runs in on ``device``, and its name: TF32's where cuDNN may run float32 convolutions
    (or matmuls) in TF32."""
    if dtype == torch.float64:
        return torch.finfo(dtype).eps, "float64 (2^-52 of each)"
    if device.type == "cuda":
        convolutions = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
        if (convolutions and torch.backends.cudnn.allow_tf32) or (
            torch.backends.cuda.matmul.allow_tf32
        ):
            return TF32_NOISE, "TF32 (2^-11 of each)"
    return FLOAT32_NOISE, "float32 (2^-23 of each)"


@dataclass(frozen=True)
class NoiseTolerances:
    """Tolerances per floating-point tensor output, keyed by its path (as
    ``compare_outputs`` names it), measured under rounding noise, and why."""

    tolerances: dict[str, Tolerance]
    rtol: float
    atol: float  # the largest of the per-output atols
    why: str

    def to_dict(self) -> dict:
        return {"rtol": self.rtol, "atol": self.atol, "why": self.why}


def noise_tolerances(
    reference: dict[str, torch.Tensor],
    noisy_runs: Sequence[dict[str, torch.Tensor]],
    rtol: float,
    unit: float,
    unit_name: str,
    margin: float = NOISE_MARGIN,
    computed_in: str = "float32",
    spread_fraction: float | None = None,
) -> NoiseTolerances:
    """Per output of ``reference`` ({path: float tensor}): ``rtol``, and ``margin``
    times the most any of ``noisy_runs`` (the same outputs of the model with its
    weights moved by ``unit`` of themselves) moved it, or ``unit`` times the output's
    largest magnitude where noise moved it less (an output that no weight reaches).
    ``computed_in`` names the arithmetic of the outputs judged, for the stated reason.
    ``spread_fraction`` of each output's range caps its tolerance (``spread_ceiling``);
    by default ``HALF_SPREAD_CEILING`` for float16 and bfloat16 outputs, none otherwise."""
    if spread_fraction is None and computed_in in ("float16", "bfloat16"):
        spread_fraction = HALF_SPREAD_CEILING
    tolerances, spread_of_all, capped = {}, 0.0, 0
    for path, tensor in reference.items():
        spread = max(_max_abs(run[path] - tensor) for run in noisy_runs)
        spread_of_all = max(spread_of_all, spread)
        moved = max(spread, unit * _max_abs(tensor))
        atol = measured = margin * moved
        ceiling = None
        source = (
            f"{computed_in}: {margin:g} x what {unit_name} rounding of the weights moved it "
            f"({moved:.2g})"
        )
        if spread_fraction is not None:
            ceiling, of = spread_ceiling(tensor, spread_fraction)
            if measured > ceiling:
                atol, capped = ceiling, capped + 1
                source += f", capped at {of} ({ceiling:.2g})"
            else:
                source += f", under the ceiling of {of} ({ceiling:.2g})"
        tolerances[path] = Tolerance(rtol=rtol, atol=atol, ceiling=ceiling, source=source)
    atol = max(t.atol for t in tolerances.values())
    why = (
        f"{computed_in} outputs within rtol {rtol:g} and atol {atol:.2g}: {margin:g} x the "
        f"most ({spread_of_all:.2g}) that {len(noisy_runs)} runs of the model with its "
        f"weights moved by the rounding of {unit_name} moved them"
    )
    if spread_fraction is not None:
        why += f", never more than {spread_fraction:.0%} of an output's range" + (
            f" ({capped} of {len(tolerances)} capped there)" if capped else ""
        )
    return NoiseTolerances(tolerances, rtol, atol, why)


def _max_abs(tensor: torch.Tensor) -> float:
    return float(tensor.detach().double().abs().max()) if tensor.numel() else 0.0
