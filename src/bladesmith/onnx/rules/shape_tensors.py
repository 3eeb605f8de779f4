"""TensorRT's shape-tensor rules: what may compute a value that becomes a shape.

TensorRT evaluates shape tensors (Resize sizes, Slice starts/ends, Reshape/Expand/Tile/
ConstantOfShape shapes) at build time. Its API documents a shape tensor as 0-D or 1-D,
Int32, Int64, Bool or Float, with at most 64 elements, and a shape tensor that is an
engine input must be an integer. Only shape layers compute them: IShapeLayer,
IConcatenationLayer, IElementWiseLayer, IGatherLayer, IIdentityLayer, IReduceLayer, plus
the shape inputs of IShuffleLayer and ISliceLayer ("Dynamic Shapes: Advanced Topics").
A unary layer (Floor, Ceil, Round, ...) and a plugin cannot.
"""

from __future__ import annotations

from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import STANDARD_DOMAINS, Dataflow, GraphView
from bladesmith.onnx.targets import Target

FLOAT_RULE = "float-shape-arithmetic"
PLUGIN_RULE = "plugin-shape-input"

# ONNX ops that TensorRT's parser maps to shape layers (see the module docstring).
TRT_SHAPE_OPS = frozenset(
    {
        "Shape", "Size", "Constant", "Identity", "Cast", "Concat", "Gather",
        "Add", "Sub", "Mul", "Div", "Min", "Max", "Pow",
        "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor",
        "ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin", "ReduceMean",
        "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice",
    }
)  # fmt: skip


def float_shape_arithmetic(view: GraphView, target: Target) -> list[Finding]:
    """Float computation on the path into a shape input."""
    if not target.trt_shape_rules:
        return []
    findings = []
    for flow in view.shape_dataflows():
        float_nodes = [
            node
            for node in flow.nodes
            if node.op_type != "Constant"
            and node.domain in STANDARD_DOMAINS
            and any(view.is_float(output) for output in node.output if output)
        ]
        float_inputs = [
            name
            for name in flow.graph_inputs
            if view.is_float(name) and _read_as_shape(view, flow, name)
        ]
        if not float_nodes and not float_inputs:
            continue
        not_shape_layers = [node for node in float_nodes if node.op_type not in TRT_SHAPE_OPS]
        labels = [f"{view.label(node)} ({node.op_type})" for node in reversed(float_nodes)]
        path = ", ".join(labels + [f"graph input {name}" for name in float_inputs])
        if not_shape_layers or float_inputs:
            reason = (
                f"{', '.join(sorted({n.op_type for n in not_shape_layers}))} is not a "
                "TensorRT shape layer, so the value cannot be computed at build time"
                if not_shape_layers
                else "a float graph input cannot be a TensorRT shape tensor"
            )
            severity = "error"
        else:
            reason = "legal float shape arithmetic in TensorRT, but rounded and fragile"
            severity = "warning"
        findings.append(
            Finding(
                rule=FLOAT_RULE,
                severity=severity,
                target=target.name,
                node=view.label(flow.consumer),
                message=(
                    f"{flow.consumer.op_type} input '{flow.input_role}' is computed in "
                    f"floating point ({path}): {reason}"
                ),
                hint=(
                    "compute sizes in integers (integer Mul/Div instead of "
                    "Cast(float)->Mul->Floor->Cast) or fix the input shapes so the "
                    "subgraph folds away; `bladesmith fix` does both where it is exact"
                ),
                related=tuple(view.label(node) for node in reversed(float_nodes)),
            )
        )
    return findings


def _read_as_shape(view: GraphView, flow: Dataflow, graph_input: str) -> bool:
    """Whether the graph input's values enter the shape path through standard ops (a
    plugin in between is plugin_shape_input's finding)."""
    readers = [node for node in view.consumers.get(graph_input, []) if node in flow.nodes]
    return graph_input == flow.tensor or any(n.domain in STANDARD_DOMAINS for n in readers)


def plugin_shape_input(view: GraphView, target: Target) -> list[Finding]:
    """A custom-domain (plugin) output on the path into a shape input."""
    if not target.trt_shape_rules:
        return []
    return [
        _plugin_finding(view, target, flow, plugins)
        for flow in view.shape_dataflows()
        if (plugins := [node for node in flow.nodes if node.domain not in STANDARD_DOMAINS])
    ]


def _plugin_finding(view: GraphView, target: Target, flow: Dataflow, plugins) -> Finding:
    names = ", ".join(f"{view.label(node)} ({node.domain}::{node.op_type})" for node in plugins)
    return Finding(
        rule=PLUGIN_RULE,
        severity="error",
        target=target.name,
        node=view.label(flow.consumer),
        message=(
            f"{flow.consumer.op_type} input '{flow.input_role}' depends on the output of "
            f"{names}: a TensorRT plugin's outputs are execution tensors, never shape tensors"
        ),
        hint=(
            "give the plugin fixed-size (padded) outputs and compute the shape from "
            "constants or from Shape of a standard op, not from the plugin's values"
        ),
        related=tuple(view.label(node) for node in plugins),
    )


RULES = (float_shape_arithmetic, plugin_shape_input)
