"""What a target rejects although it implements the operator: an attribute value, an
element type, an extra output, a rank. The facts are data (restrictions.json), each with
the document or source file it comes from; this module only evaluates their conditions.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import onnx

from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import GraphView, attribute
from bladesmith.onnx.targets import Target

RULE = "unsupported-usage"
DATA_FILE = Path(__file__).with_name("restrictions.json")


@cache
def restrictions(kernel_source: str) -> tuple[dict, ...]:
    data = json.loads(DATA_FILE.read_text())
    return tuple(data["restrictions"].get(kernel_source, ()))


def unsupported_usage(view: GraphView, target: Target) -> list[Finding]:
    """Nodes that meet a restriction of the target (see restrictions.json)."""
    findings = []
    for restriction in restrictions(target.kernel_source):
        ops = restriction["op"]
        for node in view.all_nodes():
            if node.domain not in ("", "ai.onnx") or (ops != "*" and node.op_type not in ops):
                continue
            detail = _met(view, node, restriction["condition"])
            if detail is None:
                continue
            findings.append(
                Finding(
                    rule=RULE,
                    severity=restriction["severity"],
                    target=target.name,
                    node=view.label(node),
                    message=f"{node.op_type}: {restriction['message']} ({detail}) in "
                    f"{target.title}",
                    hint=restriction["hint"],
                    source=f"{restriction['source']}; bladesmith {DATA_FILE.name}",
                )
            )
    return findings


def _met(view: GraphView, node: onnx.NodeProto, condition: dict) -> str | None:
    """What about the node meets the condition, or None when it does not."""
    if "attribute" in condition:
        value = attribute(node, condition["attribute"], condition.get("default"))
        if isinstance(value, bytes):
            value = value.decode()
        return f"{condition['attribute']}={value}" if value in condition["values"] else None
    if "attribute_not" in condition:
        values = attribute(node, condition["attribute_not"]) or []
        unexpected = [v for v in values if v != condition["value"]]
        return f"{condition['attribute_not']}={list(values)}" if unexpected else None
    if "types" in condition:
        names = [name for name in [*node.input, *node.output] if name]
        found = sorted({t for name in names if (t := view.type_string(name)) in condition["types"]})
        return ", ".join(found) or None
    if "input_rank" in condition:
        index = condition["input_rank"]
        shape = view.shape(node.input[index]) if index < len(node.input) else None
        return f"input rank {len(shape)}" if shape and len(shape) in condition["ranks"] else None
    if "output_used" in condition:
        used = [
            node.output[i]
            for i in condition["output_used"]
            if i < len(node.output) and node.output[i]
        ]
        return f"output {', '.join(used)} is used" if used else None
    if "input_given" in condition:
        given = _inputs_at(node, condition["input_given"])
        return f"input {', '.join(given)} is given" if given else None
    if "input_not_constant" in condition:
        # A parser reads such an input as weights: an initializer or a Constant's output.
        variable = [
            name
            for name in _inputs_at(node, condition["input_not_constant"])
            if view.constant_value(name) is None
        ]
        return f"input {', '.join(variable)} is not a constant" if variable else None
    if "input_nonzero" in condition:
        nonzero = [
            name
            for name in _inputs_at(node, condition["input_nonzero"])
            if (value := view.constant_value(name)) is not None and value.any()
        ]
        return f"input {', '.join(nonzero)} is not zero" if nonzero else None
    raise ValueError(f"unknown condition in {DATA_FILE.name}: {condition}")


def _inputs_at(node: onnx.NodeProto, positions: list[int]) -> list[str]:
    """The node's inputs at `positions` that are given (an optional one may be '')."""
    return [node.input[i] for i in positions if i < len(node.input) and node.input[i]]


RULES = (unsupported_usage,)
