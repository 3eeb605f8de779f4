"""The model's default-domain opset against the range the target implements: from the
provider's documentation (operator_support.json, with what happens above it) or, for the
installed ONNX Runtime providers, the newest schema version their kernels cover."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.rules.operators import DATA_FILE, operator_list
from bladesmith.onnx.targets import Target

TOO_NEW_RULE = "opset-too-new"
TOO_OLD_RULE = "opset-too-old"


@dataclass(frozen=True)
class OpsetRange:
    low: int
    high: int
    above: str  # severity above `high`: "error" (fails) or "warning" (runs, slower)
    source: str | None


def documented_range(target: Target) -> OpsetRange:
    return _range(target.kernel_source)


@cache
def _range(kernel_source: str) -> OpsetRange:
    entry = json.loads(DATA_FILE.read_text())["providers"].get(kernel_source, {})
    if "opsets" in entry:
        opsets = entry["opsets"]
        source = f"{opsets['source']}; bladesmith {DATA_FILE.name}"
        return OpsetRange(*opsets["range"], opsets["above"], source)
    kernels = operator_list(kernel_source)
    return OpsetRange(1, kernels.max_opset, "error", kernels.source)


def opset_range(target: Target) -> tuple[int, int]:
    found = documented_range(target)
    return found.low, found.high


def opset_in_range(view: GraphView, target: Target) -> list[Finding]:
    documented = documented_range(target)
    opset = view.opset
    if opset > documented.high:
        slower = documented.above == "warning"
        outcome = "higher opsets run, slowly" if slower else "higher opsets fail"
        return [
            Finding(
                rule=TOO_NEW_RULE,
                severity=documented.above,
                target=target.name,
                node=None,
                message=f"the model uses opset {opset}; {target.title} implements up to "
                f"{documented.high} ({outcome})",
                hint=(
                    f"`bladesmith fix` converts it with onnx.version_converter, or export "
                    f"with opset_version={documented.high}"
                ),
                source=documented.source,
            )
        ]
    if opset < documented.low:
        return [
            Finding(
                rule=TOO_OLD_RULE,
                severity="error",
                target=target.name,
                node=None,
                message=f"the model uses opset {opset}; {target.title} needs "
                f"{documented.low} or newer",
                hint=(
                    f"`bladesmith fix` converts it to {documented.low} where "
                    "onnx.version_converter can without changing the model's inputs; "
                    f"otherwise export again with opset_version={documented.low} or newer"
                ),
                source=documented.source,
            )
        ]
    return []


RULES = (opset_in_range,)
