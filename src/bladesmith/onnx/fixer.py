"""`fix`: rewrite an ONNX model so that it passes more of a target's rules, then check
again and confirm in ONNX Runtime that its outputs did not change.

    result = fix("model.onnx", "model.fixed.onnx", ["tensorrt"])
    result.applied     # the rewrites, each with the nodes it touched
    result.remaining   # findings `check` still reports on the fixed model

The rewrites are bladesmith.onnx.fixes, each declaring the `check` rules it resolves;
this module runs them. First the given input shapes become static and the output shapes
onnx's checker needs are declared. Then come fixes.STEPS (fold constant subgraphs, float
shape arithmetic as integers, unused initializers, opset conversion). Each step is kept
only when onnx's checker accepts its result and the model's interface is unchanged: the
same inputs and outputs, in order, with the same names, element types and ranks (else it
is skipped, with the reason in `applied`). Last, both models run on the same synthesised
inputs in ONNX Runtime's CPU provider (fixes.equivalence), the model is written (one
atomic write), and checked again.

Failures are FixError, one line each, with nothing written: InvalidInputError for an
input that is not a valid graph or that onnx's checker refuses, or an output that cannot
be written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from bladesmith._files import write_atomically
from bladesmith.onnx import fixes
from bladesmith.onnx.checker import Finding, check, has_errors, load_model
from bladesmith.onnx.fixes import output_shapes, static_input_shapes
from bladesmith.onnx.fixes.base import (
    Context,
    Fix,
    FixError,
    InvalidInputError,
    Rewrite,
    error_line,
)
from bladesmith.onnx.fixes.equivalence import (
    Verification,
    compare_in_onnxruntime,
    synthesise_inputs,
)
from bladesmith.onnx.fixes.static_input_shapes import cannot_run_at, check_input_shapes
from bladesmith.onnx.rules import validity
from bladesmith.onnx.targets import Target, resolve_targets

__all__ = [
    "FixError",
    "FixResult",
    "InvalidInputError",
    "Rewrite",
    "Verification",
    "fix",
    "synthesise_inputs",
]


@dataclass
class FixResult:
    input_path: str
    output_path: str
    targets: list[str]
    applied: list[Rewrite]
    before: list[Finding]
    remaining: list[Finding]
    verification: Verification

    @property
    def passed(self) -> bool:
        """No errors remain and the outputs were compared equal, or no comparison was asked
        for: what `bladesmith fix` exits 0 for. False when they could not be compared
        ("unverified", exit 3) or errors remain (exit 1)."""
        return self.verification.status in ("passed", "skipped") and not has_errors(self.remaining)

    def to_dict(self) -> dict:
        return {
            "input_path": self.input_path,
            "output_path": self.output_path,
            "targets": self.targets,
            "passed": self.passed,
            "applied": [
                asdict(rewrite) | {"nodes": list(rewrite.nodes)} for rewrite in self.applied
            ],
            "before": [finding.to_dict() for finding in self.before],
            "remaining": [finding.to_dict() for finding in self.remaining],
            "verification": asdict(self.verification),
        }


def fix(
    in_path: str | Path,
    out_path: str | Path,
    targets: str | Target | Iterable[str | Target],
    input_shapes: Mapping[str, Iterable[int]] | None = None,
    verify: bool = True,
) -> FixResult:
    """Write a fixed copy of the model at `in_path` to `out_path` (see the module doc).

    input_shapes: fixed dimensions for dynamic graph inputs, {name: [d0, d1, ...]}; a
        shape the model cannot run at (strict shape inference of the folded model, or
        ONNX Runtime running the original on inputs of it) is InvalidInputError.
    verify: compare the two models' outputs in ONNX Runtime; when the outputs differ
        the fixed model is not written and FixError is raised.
    """
    resolved = resolve_targets(targets)
    out_path = _writable(Path(out_path))
    if _same_file(Path(in_path), out_path):
        raise InvalidInputError(
            f"output {out_path} is the input model itself; fix leaves its input unchanged: "
            "give another output file"
        )
    original = load_model(in_path)
    before = check(original, resolved)  # an invalid graph's findings say only that
    invalid = _invalid(before)
    if invalid:
        raise InvalidInputError(f"{in_path}: {invalid[0].message}; fix rewrites valid graphs only")
    shapes = {name: [int(d) for d in dims] for name, dims in (input_shapes or {}).items()}
    check_input_shapes(original, shapes)

    context = Context(resolved, shapes, applied=[])
    model = _checkable(original, in_path, context)
    for step in fixes.STEPS:
        model = _step(step, model, context)
    remaining = check(model, resolved)
    # The input was valid: at the given shapes, folding computed what the model would.
    invalid = _invalid(remaining) if shapes else []
    if invalid:
        raise InvalidInputError(cannot_run_at(shapes, invalid[0].message))

    verification = (
        compare_in_onnxruntime(original, model, shapes)
        if verify
        else Verification("skipped", "not asked for")
    )
    if verification.status == "failed":
        what = (
            "the fixed model's outputs differ from the original's"
            if verification.outputs
            else "the fixed model could not be verified"
        )
        raise FixError(f"{what} ({verification.reason}); nothing was written to {out_path}")
    try:
        write_atomically(out_path, lambda temporary: onnx.save(model, str(temporary)))
    except (OSError, ValueError) as error:  # ValueError: protobuf's 2 GiB limit
        raise InvalidInputError(f"could not write {out_path}: {error}") from None
    return FixResult(
        input_path=str(in_path),
        output_path=str(out_path),
        targets=[target.name for target in resolved],
        applied=context.applied,
        before=before,
        remaining=remaining,
        verification=verification,
    )


def _invalid(findings: list[Finding]) -> list[Finding]:
    return [finding for finding in findings if finding.rule == validity.RULE]


def _writable(path: Path) -> Path:
    """`path` when a file can be written there, else InvalidInputError saying why."""
    if path.is_dir():
        raise InvalidInputError(f"output {path} is a folder; give a file name ending in .onnx")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInputError(f"cannot write {path}: {folder} is not a writable folder")
    return path


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are one file (the same path, or links to one file)."""
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _step(step: Fix, model: onnx.ModelProto, context: Context) -> onnx.ModelProto:
    """`step` applied to a copy of `model`, kept only when onnx's checker accepts the
    result and the model's interface (`_interface`) is unchanged; otherwise `model` as it
    was and a note saying why the step was skipped."""
    applied = context.applied
    count = len(applied)
    candidate = onnx.ModelProto()
    candidate.CopyFrom(model)
    try:
        result = step.apply(candidate, context)
        onnx.checker.check_model(result)
        _same_interface(model, result)
    except Exception as error:  # onnxslim, the converter and the checker raise many types
        del applied[count:]
        applied.append(Rewrite(step.kind, (), f"skipped: {error_line(error)}"))
        return model
    return result


def _checkable(original: onnx.ModelProto, in_path: str | Path, context: Context) -> onnx.ModelProto:
    """A copy of `original` as onnx's checker accepts it, since every step's result must
    pass the checker: the input shapes given made static, and graph outputs that declare
    no shape, which ONNX Runtime runs but the checker refuses, given the one onnx's shape
    inference finds (each said in `applied`). InvalidInputError, naming the value, when
    the checker still rejects it."""
    model = onnx.ModelProto()
    model.CopyFrom(original)
    model = static_input_shapes.FIX.apply(model, context)
    unshaped = [value.name for value in output_shapes.unshaped(model.graph.input)]
    if unshaped:
        raise InvalidInputError(
            f"{in_path}: graph input {unshaped[0]!r} declares no shape, not even its rank, "
            "which onnx's checker requires of every model fix writes; give it with "
            f"--input-shape {unshaped[0]}:D0,D1,..."
        )
    model = output_shapes.FIX.apply(model, context)
    unshaped = [value.name for value in output_shapes.unshaped(model.graph.output)]
    if unshaped:
        raise InvalidInputError(
            f"{in_path}: graph output {unshaped[0]!r} declares no shape and onnx's shape "
            "inference finds none, and onnx's checker requires one of every model fix "
            "writes; declare its rank in the model"
        )
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as error:  # ValueError: over 2 GiB
        raise InvalidInputError(
            f"{in_path}: onnx's checker rejects the model ({error_line(error)}), and fix "
            "keeps only rewrites the checker accepts; correct the model or export it again"
        ) from None
    return model


def _interface(model: onnx.ModelProto) -> tuple[list, list]:
    """The graph's inputs (initializers excluded) and outputs: (name, element type, rank),
    rank None when unknown. A rewrite may make dimensions static, nothing else here."""

    def describe(values):
        return [
            (
                value.name,
                value.type.tensor_type.elem_type,
                len(value.type.tensor_type.shape.dim)
                if value.type.tensor_type.HasField("shape")
                else None,
            )
            for value in values
        ]

    initializers = {init.name for init in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    return describe(inputs), describe(model.graph.output)


def _same_interface(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    """ValueError naming the first input or output `after` changed (name, element type,
    rank), or one it added or removed."""
    for kind, old, new in zip(("input", "output"), _interface(before), _interface(after)):
        for index in range(max(len(old), len(new))):
            was = old[index] if index < len(old) else None
            now = new[index] if index < len(new) else None
            if was == now:
                continue
            if was is None or now is None or was[0] != now[0]:
                change = f"{kind}s {[v[0] for v in old]} became {[v[0] for v in new]}"
            elif was[1] != now[1]:
                change = f"{kind} {was[0]!r} changed its element type"
            else:
                change = f"{kind} {was[0]!r} changed rank {was[2]} -> {now[2]}"
            raise ValueError(f"it would change the model's interface: {change}")
