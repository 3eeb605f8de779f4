"""Precision: the arithmetic a result computes in, as a contract a pass declares.

A precision says what the report and ``Spec.dtype`` call it (``name``), the torch dtype
its arithmetic runs in where there is one (``dtype``: int8 kernels of a runtime have
none a module could be cast to), and how a result in it is judged (``gate``):

- ``"tolerance"``: each tensor output within a tolerance measured on the model with its
  weights moved by the precision's rounding (``noise_unit``, relative), as
  ``verify.tolerance`` describes; float32, float16, bfloat16.
- ``"metric"``: the outputs move by far more than rounding (int8 steps are 1/127 of a
  range, float8 e4m3 keeps 3 mantissa bits), so no tensor tolerance tells a right result
  from a wrong one; the task's metric on held-out inputs against the model as given
  judges it instead (top-1 agreement, detection F1, or the user's ``Config(metric=...)``:
  ``verify.task_metric``).

Adding a precision is one ``Precision`` here and the pass that declares it
(``Pass.computes_in``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Gate = Literal["tolerance", "metric"]


@dataclass(frozen=True)
class Precision:
    name: str  # as Spec.dtype and the report say it: "float32", "int8"
    dtype: torch.dtype | None  # what the arithmetic runs in, where torch has it
    gate: Gate
    noise_unit: float | None = None  # the rounding of a weight, relative ("tolerance")

    @property
    def by_metric(self) -> bool:
        return self.gate == "metric"


FLOAT64 = Precision("float64", torch.float64, "tolerance", torch.finfo(torch.float64).eps)
FLOAT32 = Precision("float32", torch.float32, "tolerance", 2.0**-23)
FLOAT16 = Precision("float16", torch.float16, "tolerance", torch.finfo(torch.float16).eps / 2)
BFLOAT16 = Precision("bfloat16", torch.bfloat16, "tolerance", torch.finfo(torch.bfloat16).eps / 2)
INT8 = Precision("int8", None, "metric")
# e4m3 matrix products (3 mantissa bits): judged as int8 is
FLOAT8 = Precision("float8", torch.float8_e4m3fn, "metric")

_BY_DTYPE = {each.dtype: each for each in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16)}
_BY_NAME = {each.name: each for each in (*_BY_DTYPE.values(), INT8, FLOAT8)}


def of_dtype(dtype: torch.dtype) -> Precision:
    """The precision of arithmetic in ``dtype``: a known one, or a tolerance-gated one
    named after it (float8 and others follow ``default_tolerance``'s rule)."""
    known = _BY_DTYPE.get(dtype)
    if known is not None:
        return known
    unit = torch.finfo(dtype).eps / 2 if dtype.is_floating_point else None
    return Precision(str(dtype).removeprefix("torch."), dtype, "tolerance", unit)


def named(name: str) -> Precision:
    """The precision a spec's ``dtype`` names ("float16", "int8", "float8"): a known one,
    else arithmetic in torch's dtype of that name."""
    known = _BY_NAME.get(name)
    return known if known is not None else of_dtype(getattr(torch, name))
