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

from bladesmith._files import contents, first_line, unreadable
from bladesmith.errors import BladesmithError
from bladesmith.onnx.rules import RULES
from bladesmith.onnx.rules.finding import SEVERITIES, Finding
from bladesmith.onnx.rules.graph import GraphView
from bladesmith.onnx.rules.validity import invalid_graph
from bladesmith.onnx.targets import Target, resolve_targets

__all__ = ["Finding", "NotAModelError", "check", "graph_view", "has_errors", "load_model"]


def check(
    model_or_path: onnx.ModelProto | str | Path,
    targets: str | Target | Iterable[str | Target],
) -> list[Finding]:
    """Findings for each target, errors first within a target. The model is not changed.
    A model that is not a valid graph gets its invalid-graph findings only."""
    model = load_model(model_or_path)
    resolved = resolve_targets(targets)
    invalid = invalid_graph(model)
    if invalid:
        return invalid
    view = graph_view(model)
    findings = []
    for target in resolved:
        found = [finding for rule in RULES for finding in rule(view, target)]
        findings.extend(sorted(found, key=lambda f: SEVERITIES.index(f.severity)))
    return findings


def graph_view(model: onnx.ModelProto) -> GraphView:
    """What the rules read: the model with its local functions (model.functions, as torch
    writes for export_modules_as_functions) inlined, as ONNX Runtime runs them, so the
    operators in their bodies are judged and findings name those nodes, not the calls."""
    if not model.functions:
        return GraphView(model)
    import onnx.inliner

    try:
        return GraphView(onnx.inliner.inline_local_functions(model))
    except Exception:  # onnx's C++ inliner raises plain RuntimeErrors/ValueErrors
        return GraphView(model)  # judged as written: its calls as custom operators


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(finding.severity == "error" for finding in findings)


class NotAModelError(BladesmithError, ValueError):
    """The file is missing, unreadable, or holds no ONNX model (the CLI exits 2)."""


def load_model(model_or_path: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    """The model itself, or loaded (with its external data) from a path."""
    if isinstance(model_or_path, onnx.ModelProto):
        model, where = model_or_path, "the model"
    else:
        path = Path(model_or_path)
        problem = unreadable(path)
        if problem:
            raise NotAModelError(f"ONNX model {str(path)!r}: {problem}")
        try:
            model = onnx.load(path)
        except Exception as error:  # protobuf raises its own DecodeError, among others
            what = contents(path)
            hint = "export one with bladesmith export onnx" if "model" in what else "an ONNX file"
            raise NotAModelError(
                f"{str(path)!r} is not a readable ONNX model but {what} ({first_line(error)}); "
                f"{hint}"
            ) from error
        where = repr(str(path))
    # An empty ModelProto (no field set) holds nothing that is a model.
    if model.ByteSize() == 0:
        raise NotAModelError(f"{where} is empty: not an ONNX model")
    return model
