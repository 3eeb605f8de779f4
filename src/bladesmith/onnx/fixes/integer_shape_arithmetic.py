"""Answers `float-shape-arithmetic` where the shapes stay dynamic: float arithmetic on
dimensions, between a Cast(int -> float) and a Cast(float -> int), is done in the
dimensions' integer type instead, where that is exact.

Pattern: x (int64/int32) -> Cast(to=float) -> [Mul|Add|Sub by an integer-valued
constant, Neg, Floor|Ceil|Round, Div by a positive integer followed by Floor or Ceil,
Mul by a positive p/q (q a power of two: 1.5, 0.75) followed by Floor or Ceil]*
-> Cast(to=int) (matched by integer_chains, after separate_chains untangles torch's
exports). Equivalent: every intermediate value is then an integer, so Floor/Ceil/Round
are identities and the chain equals the same arithmetic done in x's integer type; Div
needs x >= 0 (true of dimensions read by Shape/Size, perhaps through Slice/Gather) for
integer division to be the floor; floor(x * p/q) == (x * p) div q and ceil(x / c) ==
(x + c - 1) div c for x >= 0. Exact while the float values are exact integers: below
2**24 for float32, which every tensor dimension is in practice (above it the float
original was already off).
"""

from __future__ import annotations

import onnx

from bladesmith.onnx.fixes.base import Context, Fix, Rewrite
from bladesmith.onnx.fixes.integer_chains import Step, find_integer_chain
from bladesmith.onnx.fixes.names import fresh, names_in_use, new_initializer
from bladesmith.onnx.fixes.separate_chains import separate_chains
from bladesmith.onnx.rules.graph import GraphView, attribute
from bladesmith.onnx.rules.shape_tensors import FLOAT_RULE


def _integer_shape_arithmetic(model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    """Every chain `find_integer_chain` finds, done in integers. The graph is first put
    in the form the chains are matched in (`separate_chains`), which changes no value;
    when no chain is found after that, `model` is returned as it was."""
    before = onnx.ModelProto()
    before.CopyFrom(model)
    count = len(context.applied)
    separate_chains(model)
    _rewrite_integer_chains(model, context.applied)
    return model if len(context.applied) > count else before


def _rewrite_integer_chains(model: onnx.ModelProto, applied: list[Rewrite]) -> None:
    while (match := find_integer_chain(GraphView(model))) is not None:
        view, cast, steps, final_cast = match
        graph = model.graph
        replacement = _integer_nodes(graph, view, cast, steps, final_cast)
        removed = [cast, *(node for step in steps for node in step.nodes), final_cast]
        position = list(graph.node).index(cast)
        for node in removed:
            graph.node.remove(node)
        for offset, node in enumerate(replacement):
            graph.node.insert(position + offset, node)
        dtype = onnx.TensorProto.DataType.Name(view.elem_type(cast.input[0])).lower()
        applied.append(
            Rewrite(
                FIX.kind,
                tuple(view.label(node) for node in removed),
                f"{' -> '.join(node.op_type for node in removed)} became "
                f"{' -> '.join(node.op_type for node in replacement)} in {dtype}",
            )
        )


def _integer_nodes(graph, view, cast, steps: list[Step], final_cast) -> list[onnx.NodeProto]:
    dtype = view.elem_type(cast.input[0])
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    make = onnx.helper.make_node
    taken = names_in_use(graph)
    nodes: list[onnx.NodeProto] = []
    current = cast.input[0]
    for index, step in enumerate(steps):
        if step.op == "Identity":
            continue
        name = step.nodes[0].name or fresh(taken, f"{cast.name or 'cast'}_int{index}")
        output = fresh(taken, f"{name}_int")
        if step.op == "Neg":
            nodes.append(make("Neg", [current], [output], name=name))
            current = output
            continue
        constant = new_initializer(graph, fresh(taken, f"{name}_c"), step.constant.astype(np_dtype))
        if step.op == "SubFrom":
            nodes.append(make("Sub", [constant, current], [output], name=name))
        elif step.op == "CeilDiv":  # ceil(x / c) == (x + c - 1) div c for x >= 0
            shift = new_initializer(
                graph, fresh(taken, f"{name}_shift"), (step.constant - 1).astype(np_dtype)
            )
            shifted = fresh(taken, f"{name}_shifted")
            nodes.append(
                make("Add", [current, shift], [shifted], name=fresh(taken, f"{name}_ceil"))
            )
            nodes.append(make("Div", [shifted, constant], [output], name=name))
        else:
            op = "Div" if step.op == "FloorDiv" else step.op
            nodes.append(make(op, [current, constant], [output], name=name))
        current = output
    target_dtype = attribute(final_cast, "to")
    if nodes and target_dtype == dtype:
        nodes[-1].output[0] = final_cast.output[0]
    else:
        nodes.append(
            make("Cast", [current], [final_cast.output[0]], name=final_cast.name, to=target_dtype)
        )
    return nodes


FIX = Fix("integer-shape-arithmetic", (FLOAT_RULE,), _integer_shape_arithmetic)
