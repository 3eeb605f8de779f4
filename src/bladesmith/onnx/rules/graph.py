"""A read-only view of an ONNX graph for the rules: who produces and consumes each
tensor, each tensor's element type and shape, constants, and the dataflow that feeds
shape inputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx

STANDARD_DOMAINS = frozenset({"", "ai.onnx"})
FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BFLOAT16,
    }
)

# (op_type -> input positions whose values become output shapes or indices that TensorRT
# computes at build time as shape tensors). Resize/Upsample scales are float by
# definition: for them only a value computed at run time counts.
SHAPE_INPUTS: dict[str, dict[int, str]] = {
    "Resize": {2: "scales", 3: "sizes"},
    "Upsample": {1: "scales"},
    "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"},
    "Reshape": {1: "shape"},
    "Expand": {1: "shape"},
    "Tile": {1: "repeats"},
    "ConstantOfShape": {0: "input"},
}

# Ops whose output values do not depend on their inputs' values, only on their shapes:
# a backward trace stops there.
SHAPE_READERS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class Dataflow:
    """The nodes whose outputs reach one shape input, walking backwards from it."""

    consumer: onnx.NodeProto
    input_index: int
    input_role: str
    tensor: str
    nodes: tuple[onnx.NodeProto, ...]
    graph_inputs: tuple[str, ...]  # graph inputs whose values (not shapes) reach it


class GraphView:
    """The main graph of `model` after ONNX shape inference (the model is not changed)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except (onnx.shape_inference.InferenceError, ValueError):
            inferred = model  # custom ops can defeat inference; rules use what is declared
        self.graph = inferred.graph
        self.nodes = list(self.graph.node)
        self.producer: dict[str, onnx.NodeProto] = {
            output: node for node in self.nodes for output in node.output if output
        }
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.initializers = {init.name: init for init in self.graph.initializer}
        self.value_info: dict[str, onnx.ValueInfoProto] = {
            info.name: info
            for info in [*self.graph.input, *self.graph.value_info, *self.graph.output]
        }
        self.graph_inputs = [i for i in self.graph.input if i.name not in self.initializers]
        self._positions = {id(node): index for index, node in enumerate(self.nodes)}
        self.graph_output_names = {o.name for o in self.graph.output}

    @cached_property
    def opset(self) -> int:
        """The default-domain opset the model imports."""
        for entry in self.model.opset_import:
            if entry.domain in STANDARD_DOMAINS:
                return entry.version
        return 1

    def all_nodes(self) -> list[onnx.NodeProto]:
        """Every node, those inside If/Loop/Scan bodies included."""
        found: list[onnx.NodeProto] = []
        pending = list(self.nodes)
        while pending:
            node = pending.pop(0)
            found.append(node)
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    pending.extend(attribute.g.node)
                elif attribute.type == onnx.AttributeProto.GRAPHS:
                    for subgraph in attribute.graphs:
                        pending.extend(subgraph.node)
        return found

    def label(self, node: onnx.NodeProto) -> str:
        """The node's name, or op type and position when the exporter left it unnamed."""
        if node.name:
            return node.name
        position = self._positions.get(id(node))
        return node.op_type if position is None else f"{node.op_type}#{position}"

    def elem_type(self, tensor: str) -> int | None:
        """The tensor's element type (onnx.TensorProto enum), None when unknown."""
        if tensor in self.initializers:
            return self.initializers[tensor].data_type
        info = self.value_info.get(tensor)
        if info is not None and info.type.HasField("tensor_type"):
            return info.type.tensor_type.elem_type or None
        producer = self.producer.get(tensor)
        if producer is not None and producer.op_type == "Cast":
            return attribute(producer, "to")
        if producer is not None and producer.op_type == "Constant":
            value = self.constant_value(tensor)
            return None if value is None else onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        return None

    def shape(self, tensor: str) -> list[int | str | None] | None:
        """Dimensions: int when static, the symbol's name, or None when unknown."""
        if tensor in self.initializers:
            return list(self.initializers[tensor].dims)
        info = self.value_info.get(tensor)
        if info is None or not info.type.tensor_type.HasField("shape"):
            return None
        return [
            dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None)
            for dim in info.type.tensor_type.shape.dim
        ]

    def constant_value(self, tensor: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output, else None."""
        if tensor in self.initializers:
            return onnx.numpy_helper.to_array(self.initializers[tensor])
        producer = self.producer.get(tensor)
        if producer is None or producer.op_type != "Constant":
            return None
        for attribute in producer.attribute:
            if attribute.name == "value":
                return onnx.numpy_helper.to_array(attribute.t)
            if attribute.name in ("value_int", "value_float", "value_ints", "value_floats"):
                return np.asarray(onnx.helper.get_attribute_value(attribute))
        return None

    def is_float(self, tensor: str) -> bool:
        return self.elem_type(tensor) in FLOAT_TYPES

    def shape_dataflows(self) -> list[Dataflow]:
        """For each shape input of each node (see SHAPE_INPUTS), the nodes feeding it."""
        flows = []
        for node in self.nodes:
            if node.domain not in STANDARD_DOMAINS:
                continue
            for index, role in SHAPE_INPUTS.get(node.op_type, {}).items():
                if index < len(node.input) and node.input[index]:
                    tensor = node.input[index]
                    nodes, inputs = self.upstream(tensor)
                    flows.append(Dataflow(node, index, role, tensor, nodes, inputs))
        return flows

    def upstream(self, tensor: str) -> tuple[tuple[onnx.NodeProto, ...], tuple[str, ...]]:
        """Nodes whose values reach `tensor` (nearest first), and the graph inputs whose
        values reach it. The walk stops at Shape/Size: their values are dimensions."""
        seen: dict[int, onnx.NodeProto] = {}
        inputs: list[str] = []
        input_names = {i.name for i in self.graph_inputs}
        queue = deque([tensor])
        while queue:
            name = queue.popleft()
            if name in input_names and name not in inputs:
                inputs.append(name)
            producer = self.producer.get(name)
            if producer is None or id(producer) in seen:
                continue
            seen[id(producer)] = producer
            if producer.op_type not in SHAPE_READERS:
                queue.extend(entry for entry in producer.input if entry)
        return tuple(seen.values()), tuple(inputs)


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of the node's attribute `name`, or `default` when it is not set."""
    for entry in node.attribute:
        if entry.name == name:
            return onnx.helper.get_attribute_value(entry)
    return default
