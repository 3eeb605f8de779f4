"""Dimensions the target cares about: dynamic ones, and ones that can be zero."""

from __future__ import annotations

from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.targets import Target

DYNAMIC_RULE = "dynamic-dim"
ZERO_RULE = "zero-size-dim"

# Ops whose output length depends on the data and is 0 when nothing is selected.
DATA_DEPENDENT_SIZE = frozenset({"NonZero", "Compress", "Unique", "NonMaxSuppression"})

_DYNAMIC_HINTS = {
    "tensorrt": "build with an optimization profile (trtexec --minShapes/--optShapes/"
    "--maxShapes), or fix the shape: `bladesmith fix --input-shape NAME:D0,D1,...`",
    "directml": "fix the shape (`bladesmith fix --input-shape NAME:D0,D1,...`) or set "
    "SessionOptions.add_free_dimension_override_by_name(symbol, value)",
}


def dynamic_dims(view: GraphView, target: Target) -> list[Finding]:
    """Graph inputs with dimensions that are unknown until run time."""
    if not target.static_dims:
        return []
    hint = _DYNAMIC_HINTS["tensorrt" if target.trt_shape_rules else "directml"]
    findings = []
    for graph_input in view.graph_inputs:
        shape = view.shape(graph_input.name)
        dynamic = ["rank"] if shape is None else [str(d) for d in shape if not isinstance(d, int)]
        if dynamic:
            findings.append(
                Finding(
                    rule=DYNAMIC_RULE,
                    severity=target.static_dims,
                    target=target.name,
                    node=None,
                    message=f"graph input '{graph_input.name}' has dynamic dimensions "
                    f"({', '.join(dynamic)}); {target.title} is built or tuned for fixed "
                    "shapes",
                    hint=hint,
                )
            )
    return findings


def zero_size_dims(view: GraphView, target: Target) -> list[Finding]:
    """Data tensors with a dimension that is 0, or that is 0 when the data selects nothing.
    An empty tensor no input's values reach is fixed when the engine is built, not data:
    an empty constant standing for an omitted input (Resize's roi and scales in torch's
    opset-11 exports), the shape of a 0-D tensor."""
    if not target.zero_dims:
        return []
    findings = []
    tensors = [*view.value_info, *view.initializers]
    for tensor in dict.fromkeys(tensors):
        shape = view.shape(tensor) or []
        if 0 in shape and view.upstream(tensor)[1]:
            producer = view.producer.get(tensor)
            findings.append(
                _zero_finding(
                    view,
                    target,
                    producer,
                    f"tensor '{tensor}' has shape {shape}: it is empty",
                )
            )
    for node in view.all_nodes():
        if node.op_type in DATA_DEPENDENT_SIZE:
            findings.append(
                _zero_finding(
                    view,
                    target,
                    node,
                    f"{node.op_type} output length depends on the data and is 0 when "
                    "nothing is selected",
                )
            )
    return findings


def _zero_finding(view: GraphView, target: Target, node, message: str) -> Finding:
    return Finding(
        rule=ZERO_RULE,
        severity=target.zero_dims,
        target=target.name,
        node=None if node is None else view.label(node),
        message=f"{message}; empty tensors are not handled by every layer of {target.title}",
        hint="return fixed-size padded tensors plus a count instead of data-dependent "
        "sizes (as bladesmith's own detection ops do)",
    )


RULES = (dynamic_dims, zero_size_dims)
