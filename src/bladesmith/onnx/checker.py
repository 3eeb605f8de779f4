"""`check`: run every rule against an ONNX model for one or more deployment targets.

    findings = check("model.onnx", ["tensorrt", "directml"])
    for finding in findings:
        print(finding.summary())

The rules live in bladesmith.onnx.rules; the targets in bladesmith.onnx.targets.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import onnx

from bladesmith.errors import BladesmithError
from bladesmith.onnx.rules import RULES
from bladesmith.onnx.rules.finding import SEVERITIES, Finding
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.targets import Target, resolve_targets

__all__ = ["Finding", "check", "has_errors", "load_model"]


def check(
    model_or_path: onnx.ModelProto | str | Path,
    targets: str | Target | Iterable[str | Target],
) -> list[Finding]:
    """Findings for each target, errors first within a target. The model is not changed."""
    view = GraphView(load_model(model_or_path))
    findings = []
    for target in resolve_targets(targets):
        found = [finding for rule in RULES for finding in rule(view, target)]
        findings.extend(sorted(found, key=lambda f: SEVERITIES.index(f.severity)))
    return findings


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(finding.severity == "error" for finding in findings)


def load_model(model_or_path: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    """The model itself, or loaded (with its external data) from a path."""
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    path = Path(model_or_path)
    if not path.is_file():
        raise BladesmithError(f"no ONNX model at {path}")
    try:
        return onnx.load(path)
    except Exception as error:  # protobuf raises its own DecodeError, among others
        raise BladesmithError(f"{path} is not a readable ONNX model: {error}") from error
