"""Answers `dynamic-dim`: the graph inputs named in `input_shapes` (`--input-shape`) get
those static dimensions, so a target built or tuned for fixed shapes gets them.

Equivalent at those shapes, the only ones the fixed model takes: every node computes
what it computed when the dynamic dimensions had these values. `check_input_shapes`
refuses a shape ONNX Runtime could not load (another rank, a changed static dimension, a
dimension below 1), and `fix` refuses one the model cannot run at (`cannot_run_at`).
"""

from __future__ import annotations

import math

import onnx

from bladesmith.onnx.fixes.base import Context, Fix, InvalidInputError, Rewrite
from bladesmith.onnx.rules.shapes import DYNAMIC_RULE

_INT64_MAX = 2**63 - 1


def check_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> None:
    """InvalidInputError unless each of `shapes` names a graph input (not an initializer)
    and gives it as many dimensions as it has, each >= 1, equal to its static ones: a
    shape that breaks one of these makes a model ONNX Runtime cannot load."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise InvalidInputError(
            f"input_shapes (--input-shape) names {unknown}, which are not graph inputs; "
            f"inputs are {sorted(inputs)}"
        )
    for name, dims in shapes.items():
        if not dims or min(dims) < 1:
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)}: every dimension must be >= 1"
            )
        if math.prod(dims) > _INT64_MAX:
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)}: {math.prod(dims)} "
                "elements, beyond int64, ONNX's type for sizes; give the shape of a real input"
            )
        tensor_type = inputs[name].type.tensor_type
        if not tensor_type.HasField("shape"):
            continue  # rank unknown: any shape may be right
        declared = [
            dim.dim_value if dim.HasField("dim_value") else None for dim in tensor_type.shape.dim
        ]
        shown = _dims("?" if dim is None else dim for dim in declared)
        if len(declared) != len(dims):
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)} has {len(dims)} "
                f"dimensions, but input {name!r} has {len(declared)} ({shown}); give "
                f"{len(declared)}"
            )
        clashes = [i for i, dim in enumerate(declared) if dim is not None and dim != dims[i]]
        if clashes:
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)} changes static "
                f"dimension {clashes[0]} of input {name!r} ({shown}); keep the static "
                "dimensions and set the dynamic ones (?)"
            )


def cannot_run_at(shapes: dict[str, list[int]], why: str) -> str:
    """The one-line refusal of input shapes the model cannot run at, saying `why`."""
    given = " ".join(f"{name}:{_dims(dims)}" for name, dims in shapes.items())
    return (
        f"input_shapes (--input-shape) {given}: the model cannot run at this shape ({why}); "
        "give a shape it runs at"
    )


def _dims(dims) -> str:
    return ",".join(str(dim) for dim in dims)


def _static_input_shapes(model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    shapes = context.input_shapes
    if not shapes:
        return model
    for value in model.graph.input:
        if value.name in shapes:
            shape = value.type.tensor_type.shape
            del shape.dim[:]
            shape.dim.extend(
                onnx.TensorShapeProto.Dimension(dim_value=d) for d in shapes[value.name]
            )
    fixed = ", ".join(f"{name}={dims}" for name, dims in shapes.items())
    context.applied.append(Rewrite(FIX.kind, (), f"input shapes fixed: {fixed}"))
    return model


FIX = Fix("static-input-shapes", (DYNAMIC_RULE,), _static_input_shapes)
