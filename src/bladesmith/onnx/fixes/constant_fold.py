"""Answers `float-shape-arithmetic` where the shapes are static (given or made so with
`input_shapes`): onnxslim's constant folding turns the shape arithmetic into constants,
and dead-node and common-subexpression elimination remove what is left over. Its pattern
fusions (Conv+BN, Gemm, ...) are skipped: they are optimisations, not fixes.

Equivalent: a folded node is replaced by the value it computes from constants alone,
a dead node is read by nothing, and a duplicate computes what the node kept computes.
Graph inputs nothing reads any more are put back (`_keep_inputs`): callers feed them.
"""

from __future__ import annotations

import onnx

from bladesmith.onnx.fixes.base import Context, Fix, Rewrite
from bladesmith.onnx.rules.shape_tensors import FLOAT_RULE


def _fold_constants(model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    import onnxslim

    before = [node.name for node in model.graph.node]
    folded = onnxslim.slim(
        onnx.ModelProto.FromString(model.SerializeToString()),
        skip_optimizations=["graph_fusion", "weight_tying"],
    )
    if folded is None:
        raise RuntimeError("onnxslim could not simplify the model")
    after = {node.name for node in folded.graph.node}
    removed = tuple(name for name in before if name and name not in after)
    _keep_inputs(model, folded)
    if len(folded.graph.node) < len(before):
        context.applied.append(
            Rewrite(
                FIX.kind,
                removed,
                f"onnxslim {onnxslim.__version__} folded {len(before) - len(folded.graph.node)}"
                " nodes into constants or removed them as dead",
            )
        )
    return folded


def _keep_inputs(original: onnx.ModelProto, folded: onnx.ModelProto) -> None:
    """Put back the graph inputs (and the initializers giving their defaults) that
    onnxslim removed because nothing reads them: the inputs are the model's interface,
    which callers feed by name. Kept inputs keep onnxslim's (static) shapes."""
    graph = folded.graph
    folded_inputs = {i.name: i for i in graph.input}
    folded_initializers = {i.name for i in graph.initializer}
    original_initializers = {i.name: i for i in original.graph.initializer}
    names = {i.name for i in original.graph.input}
    inputs = [folded_inputs.get(i.name, i) for i in original.graph.input]
    inputs += [i for name, i in folded_inputs.items() if name not in names]
    for graph_input in original.graph.input:
        name = graph_input.name
        if name in original_initializers and name not in folded_initializers:
            graph.initializer.append(original_initializers[name])
    del graph.input[:]
    graph.input.extend(inputs)


FIX = Fix("constant-fold", (FLOAT_RULE,), _fold_constants)
