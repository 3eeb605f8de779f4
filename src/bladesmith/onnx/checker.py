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
            raise NotAModelError(_unreadable_model(path, error)) from error
        where = repr(str(path))
    # An empty ModelProto (no field set) holds nothing that is a model.
    if model.ByteSize() == 0:
        raise NotAModelError(f"{where} is empty: not an ONNX model")
    return model


def _unreadable_model(path: Path, error: Exception) -> str:
    """Why onnx cannot load the file at `path`, in one line: its external data, when the
    model itself loads without it, else what the file holds."""
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # not a model at all
        what = contents(path)
        hint = "export one with bladesmith export onnx" if "model" in what else "an ONNX file"
        return (
            f"{str(path)!r} is not a readable ONNX model but {what} ({first_line(error)}); {hint}"
        )
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    folder = path.parent
    tensors = [tensor for tensor in model.graph.initializer if uses_external_data(tensor)]
    locations = [ExternalDataInfo(tensor).location for tensor in tensors]
    for location in dict.fromkeys(locations):
        if not (folder / location).exists():
            return (
                f"ONNX model {str(path)!r}: its external data file {location!r} is missing; "
                f"it must be next to the model, in {str(folder)!r}: copy it there"
            )
        problem = unreadable(folder / location)
        if problem:
            return f"ONNX model {str(path)!r}: its external data file {location!r}: {problem}"
    return f"ONNX model {str(path)!r}: its external data cannot be read ({first_line(error)})"
