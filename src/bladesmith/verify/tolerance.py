"""The tolerance policy: how far an output may move, by dtype, and per output.

Tensors pass element by element at ``atol + rtol * |reference|``; the defaults below
are tuned for whole-model outputs after optimisation. Detection scores get a floor of
their own (``detection_score_tolerance``).
"""

from __future__ import annotations

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
    """Override for one output; a field left None keeps the dtype's default."""

    rtol: float | None = None
    atol: float | None = None


# Detection scores come out of a whole network, whose float32 convolutions run in TF32
# on recent NVIDIA GPUs (PyTorch's default for cuDNN), in the baseline too: another
# convolution algorithm (channels_last, a compiled kernel) moves them by ~1e-3.
_DETECTION_SCORE_ATOL_FLOOR = 5e-3


def detection_score_tolerance(dtype: torch.dtype) -> float:
    """How far a matched detection's score may move: rtol + atol of ``dtype`` (scores
    lie in [0, 1]), and never less than 5e-3."""
    rtol, atol = default_tolerance(dtype)
    return max(rtol + atol, _DETECTION_SCORE_ATOL_FLOOR)
