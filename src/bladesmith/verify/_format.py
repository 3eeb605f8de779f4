"""Numbers as comparisons print them and JSON stores them."""

from __future__ import annotations

import math


def dtype_name(dtype) -> str:
    """A torch dtype as reports write it: "float16", not "torch.float16"."""
    return str(dtype).removeprefix("torch.")


def ratio(numerator: int, denominator: int) -> float:
    if denominator == 0:
        return 1.0 if numerator == 0 else 0.0
    return numerator / denominator


def finite_or_none(value: float) -> float | None:
    """JSON has no inf: an infinite ratio is written as null."""
    return value if math.isfinite(value) else None


def sci(value: float | None) -> str:
    """Compact numbers for summaries: 3.1e-3, 1e-5, 0.8, 12.5, 2e5, 0, n/a."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)  # nan, inf: a tolerance measured on non-finite outputs
    if value == 0 or 1e-2 <= abs(value) < 1e3:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
