"""Where float shape arithmetic can be done in integers: the matcher of the
integer-shape-arithmetic fix (the pattern and why it is exact are in that module's
docstring). A chain is a line of single-consumer nodes in the main graph from a
Cast(int -> float) to a Cast(float -> int); each Step says what it becomes in integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from bladesmith.onnx.rules.graph import FLOAT_TYPES, GraphView, attribute

INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


@dataclass(frozen=True)
class Step:
    # integer op: "Mul" | "Add" | "Sub" | "SubFrom" (constant - x) | "Neg" | "FloorDiv" |
    # "CeilDiv" | "Identity" (Floor/Ceil/Round of an integer)
    op: str
    constant: np.ndarray | None
    nodes: tuple[onnx.NodeProto, ...]


def find_integer_chain(view: GraphView):
    """The first Cast(int -> float) whose chain can be done in integers, with the view
    (node objects belong to it) and the chain, or None."""
    for cast in view.nodes:
        if (
            cast.op_type == "Cast"
            and attribute(cast, "to") in FLOAT_TYPES
            and view.elem_type(cast.input[0]) in INTEGER_TYPES
            and (chain := _integer_chain(view, cast)) is not None
        ):
            return view, cast, *chain
    return None


def _integer_chain(view: GraphView, cast: onnx.NodeProto):
    """(steps, final Cast) when the chain after `cast` can be done in integers, else None."""
    non_negative = _is_dimension(view, cast.input[0])
    float_type = attribute(cast, "to")
    steps: list[Step] = []
    current = cast.output[0]
    while True:
        node = _single_consumer(view, current)
        if node is None:
            return None
        if node.op_type == "Cast" and attribute(node, "to") == float_type:
            steps.append(Step("Identity", None, (node,)))  # float to the same float
        elif node.op_type == "Cast":
            return (steps, node) if attribute(node, "to") in INTEGER_TYPES else None
        if node.op_type in ("Floor", "Ceil", "Round"):
            steps.append(Step("Identity", None, (node,)))
        elif node.op_type == "Neg":
            steps.append(Step("Neg", None, (node,)))
            non_negative = False
        elif node.op_type == "Mul" and (scaled := _scaled_division(view, node, current)):
            if not non_negative:
                return None
            multiplier, divisor, rounding, between = scaled
            op = "FloorDiv" if rounding.op_type == "Floor" else "CeilDiv"
            steps += [Step("Mul", multiplier, (node,)), Step(op, divisor, (*between, rounding))]
            node = rounding
        elif node.op_type in ("Mul", "Add", "Sub"):
            constant, current_first = _integer_operand(view, node, current)
            if constant is None:
                return None
            op = node.op_type if current_first or node.op_type != "Sub" else "SubFrom"
            steps.append(Step(op, constant, (node,)))
            non_negative = non_negative and op in ("Mul", "Add") and constant.min() >= 0
        elif node.op_type == "Div":
            constant, current_first = _integer_operand(view, node, current)
            rounding = _single_consumer(view, node.output[0])
            if (
                constant is None
                or not current_first
                or constant.min() <= 0
                or not non_negative
                or rounding is None
                or rounding.op_type not in ("Floor", "Ceil")
            ):
                return None
            op = "FloorDiv" if rounding.op_type == "Floor" else "CeilDiv"
            steps.append(Step(op, constant, (node, rounding)))
            node = rounding
        else:
            return None
        current = node.output[0]


# Selections that pass dimensions through unchanged: their outputs are still >= 0.
_DIMENSION_PASSING = frozenset({"Slice", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Identity"})
_MAX_DENOMINATOR = 2**16


def _is_dimension(view: GraphView, tensor: str) -> bool:
    """Whether `tensor` holds dimensions (>= 0): read by Shape/Size, perhaps selected."""
    producer = view.producer.get(tensor)
    while producer is not None and producer.op_type in _DIMENSION_PASSING:
        producer = view.producer.get(producer.input[0])
    return producer is not None and producer.op_type in ("Shape", "Size")


def _scaled_division(view: GraphView, node: onnx.NodeProto, current: str):
    """(multiplier p, divisor q, rounding node, identity Casts between) when the Mul
    multiplies by a positive non-integer p/q with q a power of two (1.5, 0.75: float32
    holds x * p/q exactly) and is followed, perhaps through Casts to its own float type,
    by Floor or Ceil: floor(x * p/q) == (x * p) div q for x >= 0."""
    if len(node.input) != 2 or node.input[0] == node.input[1]:
        return None
    value = view.constant_value(node.input[1] if node.input[0] == current else node.input[0])
    rounding = _single_consumer(view, node.output[0])
    between = []
    while (
        rounding is not None
        and rounding.op_type == "Cast"
        and attribute(rounding, "to") == view.elem_type(node.output[0])
    ):
        between.append(rounding)
        rounding = _single_consumer(view, rounding.output[0])
    if value is None or rounding is None or rounding.op_type not in ("Floor", "Ceil"):
        return None
    value = value.astype(np.float64)
    if not np.all(np.isfinite(value)) or value.min() <= 0 or np.all(value == np.round(value)):
        return None
    divisor = 2
    while divisor <= _MAX_DENOMINATOR and not np.all(value * divisor == np.round(value * divisor)):
        divisor *= 2
    if divisor > _MAX_DENOMINATOR:
        return None
    return np.round(value * divisor), np.asarray(divisor), rounding, tuple(between)


def _integer_operand(view: GraphView, node: onnx.NodeProto, current: str):
    """The node's constant operand when it holds integer values, and whether `current`
    is the first operand."""
    if len(node.input) != 2 or node.input[0] == node.input[1]:
        return None, False
    current_first = node.input[0] == current
    value = view.constant_value(node.input[1 if current_first else 0])
    if value is None or not np.all(np.isfinite(value)) or not np.all(value == np.round(value)):
        return None, False
    return value, current_first


def _single_consumer(view: GraphView, tensor: str) -> onnx.NodeProto | None:
    """The one node reading `tensor`, None when it is read by several, returned by the
    graph or read inside an If/Loop/Scan body (which fix does not rewrite)."""
    consumers = view.consumers.get(tensor, [])
    if (
        len(consumers) != 1
        or tensor in view.graph_output_names
        or not view.in_main_graph(consumers[0])
    ):
        return None
    return consumers[0]
