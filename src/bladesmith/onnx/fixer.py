"""`fix`: rewrite an ONNX model so that it passes more of a target's rules, then check
again and confirm in ONNX Runtime that its outputs did not change.

    result = fix("model.onnx", "model.fixed.onnx", ["tensorrt"])
    result.applied     # the rewrites, each with the nodes it touched
    result.remaining   # findings `check` still reports on the fixed model

Steps, in order, each kept only when onnx's checker accepts its result and the model's
interface is unchanged: the same inputs and outputs, in order, with the same names,
element types and ranks (else skipped, with the reason in `applied`), after graph
outputs without a shape got the one onnx infers (the checker requires one):
1. fold constant subgraphs with onnxslim (shape arithmetic on static shapes disappears;
   `input_shapes` made dynamic inputs static before it);
2. rewrite what is left of float shape arithmetic as integer arithmetic, where that is
   exact (integer-shape-arithmetic, below);
3. remove initializers nothing reads;
4. convert the opset with onnx.version_converter when a target needs another one;
5. run both models on the same synthesised inputs in ONNX Runtime's CPU provider, write
   the model (one atomic write), and check it again.

Failures are FixError, one line each, with nothing written: InvalidInputError for an
input that is not a valid graph or that onnx's checker refuses, or an output that cannot
be written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from bladesmith._files import write_atomically
from bladesmith.errors import BladesmithError
from bladesmith.onnx.checker import Finding, check, has_errors, load_model
from bladesmith.onnx.rules import validity
from bladesmith.onnx.rules.graph import FLOAT_TYPES, GraphView, attribute
from bladesmith.onnx.rules.opset import opset_range
from bladesmith.onnx.targets import Target, resolve_targets

_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})
_INT64_MAX = 2**63 - 1


class FixError(BladesmithError, RuntimeError):
    """The fixed model could not be produced or its outputs differ from the original's."""


class InvalidInputError(FixError, ValueError):
    """The input is not a valid graph or the output cannot be written (the CLI exits 2)."""


@dataclass(frozen=True)
class Rewrite:
    """One change `fix` made: its kind, the nodes it removed or replaced, and how."""

    kind: str  # "constant-fold" | "integer-shape-arithmetic" | "opset-conversion"
    nodes: tuple[str, ...]
    detail: str


@dataclass
class Verification:
    """Outputs of the original and the fixed model on the same inputs (ORT CPU)."""

    # "passed" | "failed" | "skipped" (not asked for) | "unverified" (could not be run:
    # dynamic inputs without input_shapes, or ONNX Runtime cannot run the original)
    status: str
    reason: str = ""
    outputs: dict[str, str] = field(default_factory=dict)  # output -> comparison summary


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
    _check_input_shapes(original, shapes)

    applied: list[Rewrite] = []
    model = _checkable(_with_input_shapes(original, shapes, applied), in_path, applied)
    model = _step("constant-fold", lambda m: _fold_constants(m, applied), model, applied)
    model = _step("integer-shape-arithmetic", lambda m: _integer_shape_arithmetic(m, applied),
                  model, applied)  # fmt: skip
    model = _step("unused-initializers", lambda m: _drop_unused_initializers(m, applied), model,
                  applied)  # fmt: skip
    model = _step("opset-conversion", lambda m: _convert_opset(m, resolved, applied), model,
                  applied)  # fmt: skip
    remaining = check(model, resolved)
    # The input was valid: at the given shapes, folding computed what the model would.
    invalid = _invalid(remaining) if shapes else []
    if invalid:
        raise InvalidInputError(_cannot_run_at(shapes, invalid[0].message))

    verification = (
        _compare_in_onnxruntime(original, model, shapes)
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
        applied=applied,
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


def _step(kind: str, rewrite, model: onnx.ModelProto, applied: list[Rewrite]) -> onnx.ModelProto:
    """`rewrite` applied to a copy of `model`, kept only when onnx's checker accepts the
    result and the model's interface (`_interface`) is unchanged; otherwise `model` as it
    was and a note saying why the step was skipped."""
    count = len(applied)
    candidate = onnx.ModelProto()
    candidate.CopyFrom(model)
    try:
        result = rewrite(candidate)
        onnx.checker.check_model(result)
        _same_interface(model, result)
    except Exception as error:  # onnxslim, the converter and the checker raise many types
        del applied[count:]
        applied.append(Rewrite(kind, (), f"skipped: {_reason(error)}"))
        return model
    return result


def _reason(error: BaseException) -> str:
    """Why a step or a run failed: the error's whole first line (ONNX Runtime puts the
    cause after the first sentence), at most 300 characters."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _checkable(
    model: onnx.ModelProto, in_path: str | Path, applied: list[Rewrite]
) -> onnx.ModelProto:
    """`model` as onnx's checker accepts it, since every rewrite's result must pass the
    checker: graph outputs that declare no shape, which ONNX Runtime runs but the checker
    refuses, get the one onnx's shape inference finds (a copy; said in `applied`).
    InvalidInputError, naming the value, when the checker still rejects it."""
    unshaped = [value.name for value in _unshaped(model.graph.input)]
    if unshaped:
        raise InvalidInputError(
            f"{in_path}: graph input {unshaped[0]!r} declares no shape, not even its rank, "
            "which onnx's checker requires of every model fix writes; give it with "
            f"--input-shape {unshaped[0]}:D0,D1,..."
        )
    if _unshaped(model.graph.output):
        model = _with_inferred_output_shapes(model, applied)
    unshaped = [value.name for value in _unshaped(model.graph.output)]
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
            f"{in_path}: onnx's checker rejects the model ({_reason(error)}), and fix "
            "keeps only rewrites the checker accepts; correct the model or export it again"
        ) from None
    return model


def _unshaped(values) -> list[onnx.ValueInfoProto]:
    """The tensors among `values` that declare no shape (their rank unknown)."""
    return [
        value
        for value in values
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape")
    ]


def _with_inferred_output_shapes(model: onnx.ModelProto, applied: list[Rewrite]) -> onnx.ModelProto:
    """A copy of `model` whose shapeless graph outputs declare what onnx infers."""
    inferred = onnx.shape_inference.infer_shapes(model)
    by_name = {value.name: value for value in inferred.graph.output}
    result = onnx.ModelProto()
    result.CopyFrom(model)
    declared = []
    for value in _unshaped(result.graph.output):
        found = by_name[value.name].type.tensor_type
        if found.HasField("shape"):
            value.type.tensor_type.shape.CopyFrom(found.shape)
            declared.append(f"{value.name} (rank {len(found.shape.dim)})")
    if declared:
        applied.append(
            Rewrite(
                "output-shapes",
                (),
                f"declared the shapes onnx infers for outputs {', '.join(declared)}: onnx's "
                "checker requires them, ONNX Runtime does not",
            )
        )
    return result


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


def _check_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> None:
    """InvalidInputError unless each of `shapes` names a graph input (not an initializer)
    and gives it as many dimensions as it has, each >= 1, equal to its static ones: a
    shape that breaks one of these makes a model ONNX Runtime cannot load."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise InvalidInputError(
            f"input_shapes (--input-shape) names {unknown}, which are not graph inputs; "
            f"inputs are {sorted(inputs)}"
        )
    for name, dims in shapes.items():
        if not dims or min(dims) < 1:
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)}: every dimension must be >= 1"
            )
        if math.prod(dims) > _INT64_MAX:
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)}: {math.prod(dims)} "
                "elements, beyond int64, ONNX's type for sizes; give the shape of a real input"
            )
        tensor_type = inputs[name].type.tensor_type
        if not tensor_type.HasField("shape"):
            continue  # rank unknown: any shape may be right
        declared = [
            dim.dim_value if dim.HasField("dim_value") else None for dim in tensor_type.shape.dim
        ]
        shown = _dims("?" if dim is None else dim for dim in declared)
        if len(declared) != len(dims):
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)} has {len(dims)} "
                f"dimensions, but input {name!r} has {len(declared)} ({shown}); give "
                f"{len(declared)}"
            )
        clashes = [i for i, dim in enumerate(declared) if dim is not None and dim != dims[i]]
        if clashes:
            raise InvalidInputError(
                f"input_shapes (--input-shape) {name}:{_dims(dims)} changes static "
                f"dimension {clashes[0]} of input {name!r} ({shown}); keep the static "
                "dimensions and set the dynamic ones (?)"
            )


def _dims(dims) -> str:
    return ",".join(str(dim) for dim in dims)


def _with_input_shapes(
    model: onnx.ModelProto, shapes: dict[str, list[int]], applied: list[Rewrite]
) -> onnx.ModelProto:
    """A copy of `model` whose inputs named in `shapes` have those static dimensions."""
    if not shapes:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for value in result.graph.input:
        if value.name in shapes:
            shape = value.type.tensor_type.shape
            del shape.dim[:]
            shape.dim.extend(
                onnx.TensorShapeProto.Dimension(dim_value=d) for d in shapes[value.name]
            )
    fixed = ", ".join(f"{name}={dims}" for name, dims in shapes.items())
    applied.append(Rewrite("static-input-shapes", (), f"input shapes fixed: {fixed}"))
    return result


def _cannot_run_at(shapes: dict[str, list[int]], why: str) -> str:
    given = " ".join(f"{name}:{_dims(dims)}" for name, dims in shapes.items())
    return (
        f"input_shapes (--input-shape) {given}: the model cannot run at this shape ({why}); "
        "give a shape it runs at"
    )


# -- 1. constant folding ----------------------------------------------------------------


def _fold_constants(model: onnx.ModelProto, applied: list[Rewrite]) -> onnx.ModelProto:
    """onnxslim's constant folding, dead-node and common-subexpression elimination. Its
    pattern fusions (Conv+BN, Gemm, ...) are skipped: they are optimisations, not fixes."""
    import onnxslim

    before = [node.name for node in model.graph.node]
    folded = onnxslim.slim(
        onnx.ModelProto.FromString(model.SerializeToString()),
        skip_optimizations=["graph_fusion", "weight_tying"],
    )
    if folded is None:
        raise FixError("onnxslim could not simplify the model")
    after = {node.name for node in folded.graph.node}
    removed = tuple(name for name in before if name and name not in after)
    _keep_inputs(model, folded)
    if len(folded.graph.node) < len(before):
        applied.append(
            Rewrite(
                "constant-fold",
                removed,
                f"onnxslim {onnxslim.__version__} folded {len(before) - len(folded.graph.node)}"
                " nodes into constants or removed them as dead",
            )
        )
    return folded


def _keep_inputs(original: onnx.ModelProto, folded: onnx.ModelProto) -> None:
    """Put back the graph inputs (and the initializers giving their defaults) that
    onnxslim removed because nothing reads them: the inputs are the model's interface,
    which callers feed by name. Kept inputs keep onnxslim's (static) shapes."""
    graph = folded.graph
    folded_inputs = {i.name: i for i in graph.input}
    folded_initializers = {i.name for i in graph.initializer}
    original_initializers = {i.name: i for i in original.graph.initializer}
    names = {i.name for i in original.graph.input}
    inputs = [folded_inputs.get(i.name, i) for i in original.graph.input]
    inputs += [i for name, i in folded_inputs.items() if name not in names]
    for graph_input in original.graph.input:
        name = graph_input.name
        if name in original_initializers and name not in folded_initializers:
            graph.initializer.append(original_initializers[name])
    del graph.input[:]
    graph.input.extend(inputs)


# -- 2. float shape arithmetic as integers -----------------------------------------------
#
# Pattern: x (int64/int32) -> Cast(to=float) -> [Mul|Add|Sub by an integer-valued
# constant, Neg, Floor|Ceil|Round, Div by a positive integer followed by Floor or Ceil,
# Mul by a positive p/q (q a power of two: 1.5, 0.75) followed by Floor or Ceil]*
# -> Cast(to=int). Every intermediate value is then an integer, so Floor/Ceil/Round are
# identities and the chain equals the same arithmetic done in x's integer type; Div
# needs x >= 0 (true of dimensions read by Shape/Size, perhaps through Slice/Gather) for
# integer division to be the floor. Exact while the float values are exact integers:
# below 2**24 for float32, which every tensor dimension is in practice (above it the
# float original was already off).


@dataclass(frozen=True)
class _Step:
    # integer op: "Mul" | "Add" | "Sub" | "SubFrom" (constant - x) | "Neg" | "FloorDiv" |
    # "CeilDiv" | "Identity" (Floor/Ceil/Round of an integer)
    op: str
    constant: np.ndarray | None
    nodes: tuple[onnx.NodeProto, ...]


def _integer_shape_arithmetic(model: onnx.ModelProto, applied: list[Rewrite]) -> onnx.ModelProto:
    """Every chain `_find_integer_chain` finds, done in integers. The graph is first put
    in the form the chains are matched in (`_separate_chains`), which changes no value;
    when no chain is found after that, `model` is returned as it was."""
    before = onnx.ModelProto()
    before.CopyFrom(model)
    count = len(applied)
    _separate_chains(model)
    _rewrite_integer_chains(model, applied)
    return model if len(applied) > count else before


def _separate_chains(model: onnx.ModelProto) -> None:
    """Two rewrites that change no value, so that each chain from a Cast(int -> float) to
    a Cast(float -> int) is a line of single-consumer nodes, which is what torch exports
    for `interpolate(scale_factor=..., recompute_scale_factor=True)` once untangled
    (Shape -> Gather -> Cast(float) -> [Mul -> Cast -> Floor] per factor -> Unsqueeze ->
    Concat of height and width -> Cast(int64)):
    - a Cast(int -> float) read by several nodes becomes one copy per reader;
    - a Cast(float -> int) of an Unsqueeze, Squeeze or Concat of floats that only it reads
      moves above it, one Cast per data input (a cast of each element commutes with
      moving elements), until it sits right after the arithmetic."""
    graph = model.graph
    taken = _names_in_use(graph)
    graph_outputs = {output.name for output in graph.output}
    view = GraphView(model)
    for cast in list(graph.node):
        readers = view.consumers.get(cast.output[0], []) if cast.op_type == "Cast" else []
        # One per node (Mul(c, c) reads it twice); a body's reader keeps the original.
        readers = list({id(r): r for r in readers if view.in_main_graph(r)}.values())
        if (
            len(readers) < 2
            or cast.output[0] in graph_outputs
            or attribute(cast, "to") not in FLOAT_TYPES
            or view.elem_type(cast.input[0]) not in _INTEGER_TYPES
        ):
            continue
        position = list(graph.node).index(cast)
        for offset, reader in enumerate(readers[1:], start=1):
            copy = onnx.NodeProto()
            copy.CopyFrom(cast)
            copy.name = _fresh(taken, f"{cast.name or 'cast'}_{offset}")
            copy.output[0] = _fresh(taken, f"{cast.output[0]}_{offset}")
            graph.node.insert(position + offset, copy)
            index = next(i for i, node in enumerate(graph.node) if node == reader)
            node = graph.node[index]
            for slot, name in enumerate(node.input):
                if name == cast.output[0]:
                    node.input[slot] = copy.output[0]
        view = GraphView(model)  # the copies' readers, for the casts still to come
    while (hoist := _movable_cast(GraphView(model), graph_outputs)) is not None:
        mover, cast = hoist
        _move_cast_above(graph, mover, cast, taken)


# Nodes that only move elements: a cast of each element commutes with them. Their data
# inputs (the others are axes).
_MOVING = {"Unsqueeze": 1, "Squeeze": 1, "Concat": None}


def _movable_cast(view: GraphView, graph_outputs: set[str]):
    """(mover, Cast(float -> int)) where the Cast is the only reader of an Unsqueeze,
    Squeeze or Concat of floats, else None."""
    for cast in view.nodes:
        if cast.op_type != "Cast" or attribute(cast, "to") not in _INTEGER_TYPES:
            continue
        mover = view.producer.get(cast.input[0])
        if (
            mover is None
            or mover.op_type not in _MOVING
            or cast.input[0] in graph_outputs
            or len(view.consumers.get(cast.input[0], [])) != 1
        ):
            continue
        data = list(mover.input[: _MOVING[mover.op_type]])
        if all(view.elem_type(name) in FLOAT_TYPES for name in data):
            return mover, cast
    return None


def _move_cast_above(graph, mover, cast, taken: set[str]) -> None:
    nodes = list(graph.node)
    mover_index, cast_index = nodes.index(mover), nodes.index(cast)
    node = graph.node[mover_index]
    count = _MOVING[node.op_type] or len(node.input)
    casts = []
    for slot in range(count):
        name = node.input[slot]
        output = _fresh(taken, f"{name}_int")
        casts.append(
            onnx.helper.make_node(
                "Cast",
                [name],
                [output],
                name=_fresh(taken, f"{cast.name or 'cast'}_{slot}"),
                to=attribute(cast, "to"),
            )
        )
        node.input[slot] = output
    moved_from = node.output[0]
    node.output[0] = cast.output[0]
    del graph.node[cast_index]
    for offset, new in enumerate(casts):
        graph.node.insert(mover_index + offset, new)
    stale = [info for info in graph.value_info if info.name in (moved_from, cast.output[0])]
    for info in stale:
        graph.value_info.remove(info)


def _rewrite_integer_chains(model: onnx.ModelProto, applied: list[Rewrite]) -> None:
    while (match := _find_integer_chain(GraphView(model))) is not None:
        view, cast, steps, final_cast = match
        graph = model.graph
        replacement = _integer_nodes(graph, view, cast, steps, final_cast)
        removed = [cast, *(node for step in steps for node in step.nodes), final_cast]
        position = list(graph.node).index(cast)
        for node in removed:
            graph.node.remove(node)
        for offset, node in enumerate(replacement):
            graph.node.insert(position + offset, node)
        dtype = onnx.TensorProto.DataType.Name(view.elem_type(cast.input[0])).lower()
        applied.append(
            Rewrite(
                "integer-shape-arithmetic",
                tuple(view.label(node) for node in removed),
                f"{' -> '.join(node.op_type for node in removed)} became "
                f"{' -> '.join(node.op_type for node in replacement)} in {dtype}",
            )
        )


def _find_integer_chain(view: GraphView):
    """The first Cast(int -> float) whose chain can be done in integers, with the view
    (node objects belong to it) and the chain, or None."""
    for cast in view.nodes:
        if (
            cast.op_type == "Cast"
            and attribute(cast, "to") in FLOAT_TYPES
            and view.elem_type(cast.input[0]) in _INTEGER_TYPES
            and (chain := _integer_chain(view, cast)) is not None
        ):
            return view, cast, *chain
    return None


def _integer_chain(view: GraphView, cast: onnx.NodeProto):
    """(steps, final Cast) when the chain after `cast` can be done in integers, else None."""
    non_negative = _is_dimension(view, cast.input[0])
    float_type = attribute(cast, "to")
    steps: list[_Step] = []
    current = cast.output[0]
    while True:
        node = _single_consumer(view, current)
        if node is None:
            return None
        if node.op_type == "Cast" and attribute(node, "to") == float_type:
            steps.append(_Step("Identity", None, (node,)))  # float to the same float
        elif node.op_type == "Cast":
            return (steps, node) if attribute(node, "to") in _INTEGER_TYPES else None
        if node.op_type in ("Floor", "Ceil", "Round"):
            steps.append(_Step("Identity", None, (node,)))
        elif node.op_type == "Neg":
            steps.append(_Step("Neg", None, (node,)))
            non_negative = False
        elif node.op_type == "Mul" and (scaled := _scaled_division(view, node, current)):
            if not non_negative:
                return None
            multiplier, divisor, rounding, between = scaled
            op = "FloorDiv" if rounding.op_type == "Floor" else "CeilDiv"
            steps += [_Step("Mul", multiplier, (node,)), _Step(op, divisor, (*between, rounding))]
            node = rounding
        elif node.op_type in ("Mul", "Add", "Sub"):
            constant, current_first = _integer_operand(view, node, current)
            if constant is None:
                return None
            op = node.op_type if current_first or node.op_type != "Sub" else "SubFrom"
            steps.append(_Step(op, constant, (node,)))
            non_negative = non_negative and op in ("Mul", "Add") and constant.min() >= 0
        elif node.op_type == "Div":
            constant, current_first = _integer_operand(view, node, current)
            rounding = _single_consumer(view, node.output[0])
            if (
                constant is None
                or not current_first
                or constant.min() <= 0
                or not non_negative
                or rounding is None
                or rounding.op_type not in ("Floor", "Ceil")
            ):
                return None
            op = "FloorDiv" if rounding.op_type == "Floor" else "CeilDiv"
            steps.append(_Step(op, constant, (node, rounding)))
            node = rounding
        else:
            return None
        current = node.output[0]


# Selections that pass dimensions through unchanged: their outputs are still >= 0.
_DIMENSION_PASSING = frozenset({"Slice", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Identity"})
_MAX_DENOMINATOR = 2**16


def _is_dimension(view: GraphView, tensor: str) -> bool:
    """Whether `tensor` holds dimensions (>= 0): read by Shape/Size, perhaps selected."""
    producer = view.producer.get(tensor)
    while producer is not None and producer.op_type in _DIMENSION_PASSING:
        producer = view.producer.get(producer.input[0])
    return producer is not None and producer.op_type in ("Shape", "Size")


def _scaled_division(view: GraphView, node: onnx.NodeProto, current: str):
    """(multiplier p, divisor q, rounding node, identity Casts between) when the Mul
    multiplies by a positive non-integer p/q with q a power of two (1.5, 0.75: float32
    holds x * p/q exactly) and is followed, perhaps through Casts to its own float type,
    by Floor or Ceil: floor(x * p/q) == (x * p) div q for x >= 0."""
    if len(node.input) != 2 or node.input[0] == node.input[1]:
        return None
    value = view.constant_value(node.input[1] if node.input[0] == current else node.input[0])
    rounding = _single_consumer(view, node.output[0])
    between = []
    while (
        rounding is not None
        and rounding.op_type == "Cast"
        and attribute(rounding, "to") == view.elem_type(node.output[0])
    ):
        between.append(rounding)
        rounding = _single_consumer(view, rounding.output[0])
    if value is None or rounding is None or rounding.op_type not in ("Floor", "Ceil"):
        return None
    value = value.astype(np.float64)
    if not np.all(np.isfinite(value)) or value.min() <= 0 or np.all(value == np.round(value)):
        return None
    divisor = 2
    while divisor <= _MAX_DENOMINATOR and not np.all(value * divisor == np.round(value * divisor)):
        divisor *= 2
    if divisor > _MAX_DENOMINATOR:
        return None
    return np.round(value * divisor), np.asarray(divisor), rounding, tuple(between)


def _integer_operand(view: GraphView, node: onnx.NodeProto, current: str):
    """The node's constant operand when it holds integer values, and whether `current`
    is the first operand."""
    if len(node.input) != 2 or node.input[0] == node.input[1]:
        return None, False
    current_first = node.input[0] == current
    value = view.constant_value(node.input[1 if current_first else 0])
    if value is None or not np.all(np.isfinite(value)) or not np.all(value == np.round(value)):
        return None, False
    return value, current_first


def _single_consumer(view: GraphView, tensor: str) -> onnx.NodeProto | None:
    """The one node reading `tensor`, None when it is read by several, returned by the
    graph or read inside an If/Loop/Scan body (which fix does not rewrite)."""
    consumers = view.consumers.get(tensor, [])
    if (
        len(consumers) != 1
        or tensor in view.graph_output_names
        or not view.in_main_graph(consumers[0])
    ):
        return None
    return consumers[0]


def _integer_nodes(graph, view, cast, steps: list[_Step], final_cast) -> list[onnx.NodeProto]:
    dtype = view.elem_type(cast.input[0])
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    make = onnx.helper.make_node
    taken = _names_in_use(graph)
    nodes: list[onnx.NodeProto] = []
    current = cast.input[0]
    for index, step in enumerate(steps):
        if step.op == "Identity":
            continue
        name = step.nodes[0].name or _fresh(taken, f"{cast.name or 'cast'}_int{index}")
        output = _fresh(taken, f"{name}_int")
        if step.op == "Neg":
            nodes.append(make("Neg", [current], [output], name=name))
            current = output
            continue
        constant = _new_initializer(
            graph, _fresh(taken, f"{name}_c"), step.constant.astype(np_dtype)
        )
        if step.op == "SubFrom":
            nodes.append(make("Sub", [constant, current], [output], name=name))
        elif step.op == "CeilDiv":  # ceil(x / c) == (x + c - 1) div c for x >= 0
            shift = _new_initializer(
                graph, _fresh(taken, f"{name}_shift"), (step.constant - 1).astype(np_dtype)
            )
            shifted = _fresh(taken, f"{name}_shifted")
            nodes.append(
                make("Add", [current, shift], [shifted], name=_fresh(taken, f"{name}_ceil"))
            )
            nodes.append(make("Div", [shifted, constant], [output], name=name))
        else:
            op = "Div" if step.op == "FloorDiv" else step.op
            nodes.append(make(op, [current, constant], [output], name=name))
        current = output
    target_dtype = attribute(final_cast, "to")
    if nodes and target_dtype == dtype:
        nodes[-1].output[0] = final_cast.output[0]
    else:
        nodes.append(
            make("Cast", [current], [final_cast.output[0]], name=final_cast.name, to=target_dtype)
        )
    return nodes


def _names_in_use(graph: onnx.GraphProto) -> set[str]:
    names = {init.name for init in graph.initializer} | {i.name for i in graph.input}
    for node in graph.node:
        names.update([node.name, *node.input, *node.output])
    return names


def _fresh(taken: set[str], base: str) -> str:
    """`base`, or `base_2`, `base_3`... whichever is not yet a tensor or node name."""
    name, suffix = base, 1
    while name in taken:
        suffix += 1
        name = f"{base}_{suffix}"
    taken.add(name)
    return name


def _new_initializer(graph: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    return name


# -- 3. unused initializers ---------------------------------------------------------------


def _drop_unused_initializers(model: onnx.ModelProto, applied: list[Rewrite]) -> onnx.ModelProto:
    """Initializers no node (subgraphs included) reads and no output returns: dead
    weight in the file, and some parsers warn about each. One that is also a graph input
    (a default a caller may override) is part of the interface and stays."""
    graph = model.graph
    used = {name for node in GraphView(model).all_nodes() for name in node.input}
    used |= {output.name for output in graph.output}
    used |= {graph_input.name for graph_input in graph.input}
    unused = [init.name for init in graph.initializer if init.name not in used]
    if not unused:
        return model
    dropped = set(unused)
    kept = [init for init in graph.initializer if init.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    shown = ", ".join(unused[:5]) + (f" (and {len(unused) - 5} more)" if len(unused) > 5 else "")
    applied.append(Rewrite("unused-initializers", (), f"removed {len(unused)}: {shown}"))
    return model


# -- 4. opset conversion ------------------------------------------------------------------


def _convert_opset(
    model: onnx.ModelProto, targets: list[Target], applied: list[Rewrite]
) -> onnx.ModelProto:
    low = max(opset_range(target)[0] for target in targets)
    high = min(opset_range(target)[1] for target in targets)
    current = GraphView(model).opset
    wanted = min(max(current, low), high)
    if wanted == current or low > high:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, wanted)
    except Exception as error:  # the converter raises RuntimeError or its own errors
        applied.append(
            Rewrite("opset-conversion", (), f"opset {current} -> {wanted} failed: {error}")
        )
        return model
    applied.append(
        Rewrite("opset-conversion", (), f"opset {current} -> {wanted} (onnx.version_converter)")
    )
    return converted


# -- 5. verification and saving -----------------------------------------------------------


def _compare_in_onnxruntime(
    original: onnx.ModelProto, fixed: onnx.ModelProto, shapes: dict[str, list[int]]
) -> Verification:
    from bladesmith.verify import compare_tensors

    try:
        feeds = synthesise_inputs(original, shapes)
    except (ValueError, MemoryError) as error:  # MemoryError: inputs too large to make
        return Verification("unverified", _reason(error))
    try:
        session = _cpu_session(original)
    except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
        return Verification("unverified", f"ONNX Runtime CPU cannot run it: {_reason(error)}")
    try:
        references = session.run(None, feeds)
    except Exception as error:
        if shapes:  # it loads, but not at the shape given
            raise InvalidInputError(
                _cannot_run_at(shapes, f"ONNX Runtime CPU: {_reason(error)}")
            ) from None
        return Verification("unverified", f"ONNX Runtime CPU cannot run it: {_reason(error)}")
    try:
        candidates = _cpu_session(fixed).run(None, feeds)
    except Exception as error:
        return Verification(
            "failed",
            "ONNX Runtime CPU runs the original on synthesised inputs but not the fixed "
            f"model on the same inputs, so no outputs were compared: {_reason(error)}",
        )
    names = [output.name for output in original.graph.output]
    verification = Verification("passed")
    for name, reference, candidate in zip(names, references, candidates, strict=True):
        comparison = compare_tensors(reference, candidate)
        verification.outputs[name] = comparison.summary()
        if not comparison.passed:
            verification.status = "failed"
            verification.reason = f"output {name}: {comparison.summary()}"
    return verification


def _cpu_session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures come back as exceptions, said in one line
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def synthesise_inputs(
    model: onnx.ModelProto, shapes: Mapping[str, list[int]] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs for every graph input; ValueError names an input whose shape is not
    fixed (neither static in the model nor given in `shapes`) or that is not a numeric
    tensor (a sequence, an optional, strings)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        tensor_type = graph_input.type.tensor_type
        if graph_input.type.WhichOneof("value") != "tensor_type" or tensor_type.elem_type in (
            0,
            onnx.TensorProto.STRING,
        ):
            raise ValueError(
                f"input {graph_input.name!r} is not a numeric tensor; random values for it "
                "cannot be made"
            )
        dims = shapes.get(graph_input.name) or [
            dim.dim_value if dim.HasField("dim_value") else None for dim in tensor_type.shape.dim
        ]
        if any(dim is None for dim in dims):
            raise ValueError(
                f"input {graph_input.name!r} has dynamic dimensions; give input_shapes "
                "to verify the fixed model"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[graph_input.name] = rng.standard_normal(dims).astype(dtype)
        elif dtype == np.bool_:
            feeds[graph_input.name] = rng.random(dims) < 0.5
        else:
            feeds[graph_input.name] = rng.integers(0, 8, size=dims).astype(dtype)
    return feeds
