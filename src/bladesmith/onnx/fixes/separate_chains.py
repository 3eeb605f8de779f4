"""Put a graph in the form the integer-shape-arithmetic fix matches chains in, without
changing any value (see `separate_chains`)."""

from __future__ import annotations

import onnx

from bladesmith.onnx.fixes.integer_chains import INTEGER_TYPES
from bladesmith.onnx.fixes.names import fresh, names_in_use
from bladesmith.onnx.rules.graph import FLOAT_TYPES, GraphView, attribute


def separate_chains(model: onnx.ModelProto) -> None:
    """Two rewrites that change no value, so that each chain from a Cast(int -> float) to
    a Cast(float -> int) is a line of single-consumer nodes, which is what torch exports
    for `interpolate(scale_factor=..., recompute_scale_factor=True)` once untangled
    (Shape -> Gather -> Cast(float) -> [Mul -> Cast -> Floor] per factor -> Unsqueeze ->
    Concat of height and width -> Cast(int64)):
    - a Cast(int -> float) read by several nodes becomes one copy per reader;
    - a Cast(float -> int) of an Unsqueeze, Squeeze or Concat of floats that only it reads
      moves above it, one Cast per data input (a cast of each element commutes with
      moving elements), until it sits right after the arithmetic."""
    graph = model.graph
    taken = names_in_use(graph)
    graph_outputs = {output.name for output in graph.output}
    view = GraphView(model)
    for cast in list(graph.node):
        readers = view.consumers.get(cast.output[0], []) if cast.op_type == "Cast" else []
        # One per node (Mul(c, c) reads it twice); a body's reader keeps the original.
        readers = list({id(r): r for r in readers if view.in_main_graph(r)}.values())
        if (
            len(readers) < 2
            or cast.output[0] in graph_outputs
            or attribute(cast, "to") not in FLOAT_TYPES
            or view.elem_type(cast.input[0]) not in INTEGER_TYPES
        ):
            continue
        position = list(graph.node).index(cast)
        for offset, reader in enumerate(readers[1:], start=1):
            copy = onnx.NodeProto()
            copy.CopyFrom(cast)
            copy.name = fresh(taken, f"{cast.name or 'cast'}_{offset}")
            copy.output[0] = fresh(taken, f"{cast.output[0]}_{offset}")
            graph.node.insert(position + offset, copy)
            index = next(i for i, node in enumerate(graph.node) if node == reader)
            node = graph.node[index]
            for slot, name in enumerate(node.input):
                if name == cast.output[0]:
                    node.input[slot] = copy.output[0]
        view = GraphView(model)  # the copies' readers, for the casts still to come
    while (hoist := _movable_cast(GraphView(model), graph_outputs)) is not None:
        mover, cast = hoist
        _move_cast_above(graph, mover, cast, taken)


# Nodes that only move elements: a cast of each element commutes with them. Their data
# inputs (the others are axes).
_MOVING = {"Unsqueeze": 1, "Squeeze": 1, "Concat": None}


def _movable_cast(view: GraphView, graph_outputs: set[str]):
    """(mover, Cast(float -> int)) where the Cast is the only reader of an Unsqueeze,
    Squeeze or Concat of floats, else None."""
    for cast in view.nodes:
        if cast.op_type != "Cast" or attribute(cast, "to") not in INTEGER_TYPES:
            continue
        mover = view.producer.get(cast.input[0])
        if (
            mover is None
            or mover.op_type not in _MOVING
            or cast.input[0] in graph_outputs
            or len(view.consumers.get(cast.input[0], [])) != 1
        ):
            continue
        data = list(mover.input[: _MOVING[mover.op_type]])
        if all(view.elem_type(name) in FLOAT_TYPES for name in data):
            return mover, cast
    return None


def _move_cast_above(graph, mover, cast, taken: set[str]) -> None:
    nodes = list(graph.node)
    mover_index, cast_index = nodes.index(mover), nodes.index(cast)
    node = graph.node[mover_index]
    count = _MOVING[node.op_type] or len(node.input)
    casts = []
    for slot in range(count):
        name = node.input[slot]
        output = fresh(taken, f"{name}_int")
        casts.append(
            onnx.helper.make_node(
                "Cast",
                [name],
                [output],
                name=fresh(taken, f"{cast.name or 'cast'}_{slot}"),
                to=attribute(cast, "to"),
            )
        )
        node.input[slot] = output
    moved_from = node.output[0]
    node.output[0] = cast.output[0]
    del graph.node[cast_index]
    for offset, new in enumerate(casts):
        graph.node.insert(mover_index + offset, new)
    stale = [info for info in graph.value_info if info.name in (moved_from, cast.output[0])]
    for info in stale:
        graph.value_info.remove(info)
