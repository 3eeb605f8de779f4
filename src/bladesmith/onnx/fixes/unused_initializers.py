"""Resolves no `check` rule; it tidies: initializers no node (subgraphs included) reads
and no output returns are dead weight in the file, and some parsers warn about each.
Folding and the integer rewrite leave such constants behind (a float divisor nothing
divides by any more).

Equivalent: nothing reads them. One that is also a graph input (a default a caller may
override) is part of the interface and stays.
"""

from __future__ import annotations

import onnx

from bladesmith.onnx.fixes.base import Context, Fix, Rewrite
from bladesmith.onnx.rules.graph import GraphView


def _drop_unused_initializers(model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    graph = model.graph
    used = {name for node in GraphView(model).all_nodes() for name in node.input}
    used |= {output.name for output in graph.output}
    used |= {graph_input.name for graph_input in graph.input}
    unused = [init.name for init in graph.initializer if init.name not in used]
    if not unused:
        return model
    dropped = set(unused)
    kept = [init for init in graph.initializer if init.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    shown = ", ".join(unused[:5]) + (f" (and {len(unused) - 5} more)" if len(unused) > 5 else "")
    context.applied.append(Rewrite(FIX.kind, (), f"removed {len(unused)}: {shown}"))
    return model


FIX = Fix("unused-initializers", (), _drop_unused_initializers)
