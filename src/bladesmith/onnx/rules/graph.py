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
    """The graph of `model` after ONNX shape inference (the model is not changed). `nodes`
    are the main graph's; producers, consumers, initializers and value infos cover the
    If/Loop/Scan bodies too (ONNX names each value once in the whole model), so a rule
    that starts from `all_nodes()` follows dataflow inside a body and out of it."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except (onnx.shape_inference.InferenceError, ValueError):
            inferred = model  # custom ops can defeat inference; rules use what is declared
        self.graph = inferred.graph
        self.nodes = list(self.graph.node)
        graphs = _graphs(self.graph)
        self._all_nodes = [node for graph in graphs for node in graph.node]
        self.producer: dict[str, onnx.NodeProto] = {
            output: node for node in self._all_nodes for output in node.output if output
        }
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self._all_nodes:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        # The main graph last: its declarations win over a body's for the same name.
        self.initializers = {i.name: i for g in reversed(graphs) for i in g.initializer}
        self.value_info: dict[str, onnx.ValueInfoProto] = {
            info.name: info
            for graph in reversed(graphs)
            for info in [*graph.input, *graph.value_info, *graph.output]
        }
        self.graph_inputs = [i for i in self.graph.input if i.name not in self.initializers]
        # Values that come from outside their graph: the model's inputs, a body's inputs.
        self.input_names = {i.name for g in graphs for i in g.input} - set(self.initializers)
        self._positions = {id(node): index for index, node in enumerate(self.nodes)}
        self.graph_output_names = {o.name for o in self.graph.output}

    @cached_property
    def opset(self) -> int:
        """The default-domain opset the model imports."""
        for entry in self.model.opset_import:
            if entry.domain in STANDARD_DOMAINS:
                return entry.version
        return 1

    @cached_property
    def opsets(self) -> dict[str, int]:
        """Imported opset per domain ("" for the default one)."""
        return {
            "" if entry.domain in STANDARD_DOMAINS else entry.domain: entry.version
            for entry in self.model.opset_import
        }

    def type_proto(self, tensor: str) -> onnx.TypeProto | None:
        """The tensor's declared or inferred type, None when unknown."""
        if tensor in self.initializers:
            init = self.initializers[tensor]
            return onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
        info = self.value_info.get(tensor)
        if info is None or not info.type.WhichOneof("value"):
            return None
        return info.type

    def type_string(self, tensor: str) -> str | None:
        """The type as ONNX and ONNX Runtime spell it ("tensor(float)", "seq(tensor(int64))"),
        None when unknown."""
        type_proto = self.type_proto(tensor)
        if type_proto is None:
            elem_type = self.elem_type(tensor)
            return None if elem_type is None else _type_string_of_elem(elem_type)
        return type_string(type_proto)

    def all_nodes(self) -> list[onnx.NodeProto]:
        """Every node, those inside If/Loop/Scan bodies included."""
        return list(self._all_nodes)

    def in_main_graph(self, node: onnx.NodeProto) -> bool:
        return id(node) in self._positions

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
        for node in self._all_nodes:
            if node.domain not in STANDARD_DOMAINS:
                continue
            for index, role in SHAPE_INPUTS.get(node.op_type, {}).items():
                if index < len(node.input) and node.input[index]:
                    tensor = node.input[index]
                    nodes, inputs = self.upstream(tensor)
                    flows.append(Dataflow(node, index, role, tensor, nodes, inputs))
        return flows

    def upstream(self, tensor: str) -> tuple[tuple[onnx.NodeProto, ...], tuple[str, ...]]:
        """Nodes whose values reach `tensor` (nearest first), and the graph inputs (a
        body's included) whose values reach it. The walk stops at Shape/Size: their values
        are dimensions."""
        seen: dict[int, onnx.NodeProto] = {}
        inputs: list[str] = []
        queue = deque([tensor])
        while queue:
            name = queue.popleft()
            if name in self.input_names and name not in inputs:
                inputs.append(name)
            producer = self.producer.get(name)
            if producer is None or id(producer) in seen:
                continue
            seen[id(producer)] = producer
            if producer.op_type not in SHAPE_READERS:
                queue.extend(entry for entry in producer.input if entry)
        return tuple(seen.values()), tuple(inputs)


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """`graph` and every If/Loop/Scan body in it, at any depth: the main graph first."""
    found = [graph]
    for node in graph.node:
        for entry in node.attribute:
            for body in [entry.g] if entry.type == onnx.AttributeProto.GRAPH else entry.graphs:
                found.extend(_graphs(body))
    return found


def type_string(type_proto: onnx.TypeProto) -> str | None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return _type_string_of_elem(type_proto.tensor_type.elem_type)
    if kind == "sparse_tensor_type":
        inner = _type_string_of_elem(type_proto.sparse_tensor_type.elem_type)
        return None if inner is None else f"sparse_{inner}"
    if kind in ("sequence_type", "optional_type"):
        inner = type_string(getattr(type_proto, kind).elem_type)
        wrapper = "seq" if kind == "sequence_type" else "optional"
        return None if inner is None else f"{wrapper}({inner})"
    if kind == "map_type":
        key = onnx.TensorProto.DataType.Name(type_proto.map_type.key_type).lower()
        value = type_string(type_proto.map_type.value_type)
        return None if value is None else f"map({key},{value})"
    return None


def _type_string_of_elem(elem_type: int) -> str | None:
    if not elem_type:
        return None
    return f"tensor({onnx.TensorProto.DataType.Name(elem_type).lower()})"


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of the node's attribute `name`, or `default` when it is not set."""
    for entry in node.attribute:
        if entry.name == name:
            return onnx.helper.get_attribute_value(entry)
    return default
