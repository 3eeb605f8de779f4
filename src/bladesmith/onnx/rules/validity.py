"""Whether the file is a graph the other rules can judge: it has a graph and an opset,
every value a node reads comes from somewhere, no node depends on itself, and ONNX's
strict shape and type inference accepts it (a Conv whose input has the wrong rank, an Add
of float and int64: what ONNX Runtime refuses to load). Each problem is one finding for
the whole model (target 'all'); when there is one, no other rule runs."""

from __future__ import annotations

import onnx

from bladesmith.onnx.rules.finding import Finding

RULE = "invalid-graph"


def invalid_graph(model: onnx.ModelProto) -> list[Finding]:
    """One finding per problem: no graph, no default-domain opset, inputs nothing
    produces, a cycle, or (when the graph has none of those) a node that ONNX's strict
    shape and type inference rejects."""
    problems = []
    if not model.HasField("graph"):
        problems.append(("the model has no graph", "export the model again"))
    if not model.opset_import:
        problems.append(
            (
                "the model imports no opset, so no operator can be resolved",
                "add an opset_import entry for domain '' (onnx.helper.make_opsetid('', N))",
            )
        )
    if model.HasField("graph"):
        dangling = _dangling_inputs(model.graph)
        if dangling:
            problems.append(
                (
                    f"node inputs that no node, graph input or initializer provides: "
                    f"{_first(dangling)}",
                    "add the missing graph inputs or initializers, or remove the nodes",
                )
            )
        cycle = _cycle(model.graph)
        if cycle:
            problems.append(
                (
                    f"the graph has a cycle through {_first(cycle)}",
                    "a graph must be acyclic; loops belong in a Loop or Scan body",
                )
            )
    if not problems:
        inference = _inference_error(model)
        if inference:
            problems.append(
                (
                    f"ONNX's strict shape and type inference rejects the graph: {inference}",
                    "ONNX Runtime refuses such a model too: correct the node, or the shapes "
                    "of the graph inputs that reach it, or export the model again",
                )
            )
    return [
        Finding(rule=RULE, severity="error", target="all", node=None, message=m, hint=h)
        for m, h in problems
    ]


def _first(names: list[str], count: int = 5) -> str:
    more = f" (and {len(names) - count} more)" if len(names) > count else ""
    return ", ".join(names[:count]) + more


def _dangling_inputs(graph: onnx.GraphProto) -> list[str]:
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    available |= {i.values.name for i in graph.sparse_initializer}
    available |= {name for node in graph.node for name in node.output}
    return list(
        dict.fromkeys(
            name for node in graph.node for name in node.input if name and name not in available
        )
    )


def _cycle(graph: onnx.GraphProto) -> list[str]:
    """Labels of the nodes left after removing, again and again, the nodes whose inputs
    are all ready (Kahn's algorithm): those on or behind a cycle."""
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    waiting = {
        index: {producer[name] for name in node.input if name in producer}
        for index, node in enumerate(graph.node)
    }
    done: set[int] = set()
    ready = [index for index, needs in waiting.items() if not needs]
    consumers: dict[int, list[int]] = {}
    for index, needs in waiting.items():
        for need in needs:
            consumers.setdefault(need, []).append(index)
    while ready:
        index = ready.pop()
        done.add(index)
        for consumer in consumers.get(index, []):
            waiting[consumer].discard(index)
            if not waiting[consumer] and consumer not in done:
                ready.append(consumer)
    return [
        graph.node[i].name or f"{graph.node[i].op_type}#{i}"
        for i in range(len(graph.node))
        if i not in done
    ]


def _inference_error(model: onnx.ModelProto) -> str | None:
    """The first error of onnx's strict shape and type inference, in one line, or None.

    An error inside an ONNX function body's expansion (onnx infers a function operator
    without an inference function of its own through its body) is not reported: onnx
    1.23 fails on some valid bodies (MeanVarianceNormalization's Constant with a
    referenced attribute), and ONNX Runtime runs such operators with its own kernels."""
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError as error:
        message = " ".join(str(error).split())
        if message.count("(op_type:") > 1:  # nested: inside a function body
            return None
        return message[:500]
    except (ValueError, onnx.checker.ValidationError):  # > 2 GiB, or not serialisable
        return None
    return None
