"""Answers `opset-too-new` and `opset-too-old`: the model's default-domain opset is
converted with onnx.version_converter to the nearest one every target implements.

Equivalent as far as the converter's adapters are (each maps one operator version to
another with the same semantics); `fix` does not take that on trust: a conversion that
changes the model's interface is skipped, and the outputs are compared in ONNX Runtime.
"""

from __future__ import annotations

import onnx

from bladesmith.onnx.fixes.base import Context, Fix, Rewrite
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.rules.opset import TOO_NEW_RULE, TOO_OLD_RULE, opset_range


def _convert_opset(model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    low = max(opset_range(target)[0] for target in context.targets)
    high = min(opset_range(target)[1] for target in context.targets)
    current = GraphView(model).opset
    wanted = min(max(current, low), high)
    if wanted == current or low > high:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, wanted)
    except Exception as error:  # the converter raises RuntimeError or its own errors
        context.applied.append(
            Rewrite(FIX.kind, (), f"opset {current} -> {wanted} failed: {error}")
        )
        return model
    context.applied.append(
        Rewrite(FIX.kind, (), f"opset {current} -> {wanted} (onnx.version_converter)")
    )
    return converted


FIX = Fix("opset-conversion", (TOO_NEW_RULE, TOO_OLD_RULE), _convert_opset)
