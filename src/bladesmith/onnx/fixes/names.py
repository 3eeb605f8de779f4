"""Fresh node and tensor names for what a fix adds to a graph."""

from __future__ import annotations

import numpy as np
import onnx


def names_in_use(graph: onnx.GraphProto) -> set[str]:
    names = {init.name for init in graph.initializer} | {i.name for i in graph.input}
    for node in graph.node:
        names.update([node.name, *node.input, *node.output])
    return names


def fresh(taken: set[str], base: str) -> str:
    """`base`, or `base_2`, `base_3`... whichever is not yet a tensor or node name."""
    name, suffix = base, 1
    while name in taken:
        suffix += 1
        name = f"{base}_{suffix}"
    taken.add(name)
    return name


def new_initializer(graph: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    return name
