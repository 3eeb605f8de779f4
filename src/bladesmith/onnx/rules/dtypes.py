"""Element types the target narrows: TensorRT 8 stores INT64 as INT32."""

from __future__ import annotations

import numpy as np
import onnx

from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.targets import Target

INT64_RULE = "int64-narrowed"

_INT32 = np.iinfo(np.int32)
# Slice bounds past the end mean "to the end" whether clamped to INT32 or not.
_CLAMP_SAFE_INPUTS = {"Slice": (1, 2)}


def int64_narrowed(view: GraphView, target: Target) -> list[Finding]:
    """INT64 graph inputs/outputs (bound as INT32) and INT64 constants that do not fit
    INT32 (clamped, changing their value)."""
    if not target.int64_narrowed:
        return []
    findings = []
    for info in [*view.graph_inputs, *view.graph.output]:
        if info.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            findings.append(
                Finding(
                    rule=INT64_RULE,
                    severity="info",
                    target=target.name,
                    node=None,
                    message=f"graph input/output '{info.name}' is INT64; {target.title} "
                    "binds it as INT32",
                    hint="feed and read int32 buffers with a standalone engine; ONNX "
                    "Runtime's TensorRT provider casts for you",
                )
            )
    for tensor in _int64_constants(view):
        value = view.constant_value(tensor)
        if value is None or value.size == 0:
            continue
        if _INT32.min <= value.min() and value.max() <= _INT32.max:
            continue
        for consumer in view.consumers.get(tensor, []):
            if _clamp_is_safe(consumer, tensor):
                continue
            findings.append(
                Finding(
                    rule=INT64_RULE,
                    severity="warning",
                    target=target.name,
                    node=view.label(consumer),
                    message=f"INT64 constant '{tensor}' holds values outside INT32 "
                    f"({value.min()}..{value.max()}); {target.title} clamps them",
                    hint="use values that fit in INT32, or target TensorRT 10, which keeps INT64",
                )
            )
    return findings


def _int64_constants(view: GraphView) -> list[str]:
    names = [n for n, init in view.initializers.items() if init.data_type == onnx.TensorProto.INT64]
    names += [
        output
        for node in view.all_nodes()
        if node.op_type == "Constant"
        for output in node.output
        if view.elem_type(output) == onnx.TensorProto.INT64
    ]
    return names


def _clamp_is_safe(consumer: onnx.NodeProto, tensor: str) -> bool:
    positions = _CLAMP_SAFE_INPUTS.get(consumer.op_type, ())
    return all(index in positions for index, name in enumerate(consumer.input) if name == tensor)


RULES = (int64_narrowed,)
