"""What every fix shares: the Fix it declares, the Context it reads, the Rewrite it
records, and the errors `fix` raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from bladesmith.errors import BladesmithError
from bladesmith.onnx.targets import Target


class FixError(BladesmithError, RuntimeError):
    """The fixed model could not be produced or its outputs differ from the original's."""


class InvalidInputError(FixError, ValueError):
    """The input is not a valid graph or the output cannot be written (the CLI exits 2)."""


@dataclass(frozen=True)
class Rewrite:
    """One change `fix` made: its kind (the Fix's), the nodes it removed or replaced, and
    how."""

    kind: str
    nodes: tuple[str, ...]
    detail: str


@dataclass(frozen=True)
class Context:
    """What a fix reads besides the model: the targets, the static shapes given for
    dynamic graph inputs ({name: [d0, d1, ...]}), and `applied`, where it records each
    Rewrite it made."""

    targets: list[Target]
    input_shapes: dict[str, list[int]]
    applied: list[Rewrite]


@dataclass(frozen=True)
class Fix:
    """One rewrite. `kind`: the Rewrite kind it records; `resolves`: the ids of the
    `check` rules whose findings it resolves (none for one that only tidies or prepares);
    `apply`: the rewrite, which may change the model it is given and returns the result
    (that model when nothing matched)."""

    kind: str
    resolves: tuple[str, ...]
    apply: Callable[[onnx.ModelProto, Context], onnx.ModelProto]


def error_line(error: BaseException) -> str:
    """Why a step or a run failed: the error's whole first line (ONNX Runtime puts the
    cause after the first sentence), at most 300 characters."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
