"""Resolves no `check` rule: graph outputs that declare no shape get the one onnx's
shape inference finds. ONNX Runtime runs such a model, but onnx's checker refuses it, and
`fix` keeps only rewrites the checker accepts, so every other fix needs this first.

Equivalent: a declared shape is metadata, and inference derives it from the nodes that
compute the output; no node or value changes.
"""

from __future__ import annotations

import onnx

from bladesmith.onnx.fixes.base import Context, Fix, Rewrite


def unshaped(values) -> list[onnx.ValueInfoProto]:
    """The tensors among `values` that declare no shape (their rank unknown)."""
    return [
        value
        for value in values
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape")
    ]


def _declare_output_shapes(model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    if not unshaped(model.graph.output):
        return model
    inferred = onnx.shape_inference.infer_shapes(model)
    by_name = {value.name: value for value in inferred.graph.output}
    declared = []
    for value in unshaped(model.graph.output):
        found = by_name[value.name].type.tensor_type
        if found.HasField("shape"):
            value.type.tensor_type.shape.CopyFrom(found.shape)
            declared.append(f"{value.name} (rank {len(found.shape.dim)})")
    if declared:
        context.applied.append(
            Rewrite(
                FIX.kind,
                (),
                f"declared the shapes onnx infers for outputs {', '.join(declared)}: onnx's "
                "checker requires them, ONNX Runtime does not",
            )
        )
    return model


FIX = Fix("output-shapes", (), _declare_output_shapes)
