"""The model's default-domain opset against the range the target implements."""

from __future__ import annotations

from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.rules.operators import operator_list
from bladesmith.onnx.targets import Target

TOO_NEW_RULE = "opset-too-new"
TOO_OLD_RULE = "opset-too-old"


def opset_range(target: Target) -> tuple[int, int]:
    """The target's documented range, or for ONNX Runtime providers the newest schema
    version their kernels cover."""
    if target.opset_range is not None:
        return target.opset_range
    return 1, operator_list(target.kernel_source).max_opset


def opset_in_range(view: GraphView, target: Target) -> list[Finding]:
    low, high = opset_range(target)
    opset = view.opset
    if opset > high:
        return [
            Finding(
                rule=TOO_NEW_RULE,
                severity="error",
                target=target.name,
                node=None,
                message=f"the model uses opset {opset}; {target.title} implements up to {high}",
                hint=(
                    f"`bladesmith fix` converts it with onnx.version_converter, or export "
                    f"with opset_version={high}"
                ),
            )
        ]
    if opset < low:
        return [
            Finding(
                rule=TOO_OLD_RULE,
                severity="error",
                target=target.name,
                node=None,
                message=f"the model uses opset {opset}; {target.title} needs {low} or newer",
                hint=f"`bladesmith fix` converts it with onnx.version_converter to {low}",
            )
        ]
    return []


RULES = (opset_in_range,)
