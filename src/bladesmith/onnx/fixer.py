"""`fix`: rewrite an ONNX model so that it passes more of a target's rules, then check
again and confirm in ONNX Runtime that its outputs did not change.

    result = fix("model.onnx", "model.fixed.onnx", ["tensorrt"])
    result.applied     # the rewrites, each with the nodes it touched
    result.remaining   # findings `check` still reports on the fixed model

Steps, in order:
1. fold constant subgraphs with onnxslim (shape arithmetic on static shapes disappears;
   `input_shapes` makes dynamic inputs static first);
2. rewrite what is left of float shape arithmetic as integer arithmetic, where that is
   exact (integer-shape-arithmetic, below);
3. convert the opset with onnx.version_converter when a target needs another one;
4. write the model (a temporary file, then a rename), re-check it, and run both models
   on the same synthesised inputs in ONNX Runtime's CPU provider.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from bladesmith._files import write_atomically
from bladesmith.errors import BladesmithError
from bladesmith.onnx.checker import Finding, check, load_model
from bladesmith.onnx.rules.graph import FLOAT_TYPES, GraphView, attribute
from bladesmith.onnx.rules.opset import opset_range
from bladesmith.onnx.targets import Target, resolve_targets

_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


class FixError(BladesmithError, RuntimeError):
    """The fixed model could not be produced or its outputs differ from the original's."""


@dataclass(frozen=True)
class Rewrite:
    """One change `fix` made: its kind, the nodes it removed or replaced, and how."""

    kind: str  # "constant-fold" | "integer-shape-arithmetic" | "opset-conversion"
    nodes: tuple[str, ...]
    detail: str


@dataclass
class Verification:
    """Outputs of the original and the fixed model on the same inputs (ORT CPU)."""

    status: str  # "passed" | "failed" | "skipped"
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
        """No errors remain and the outputs were not found to differ."""
        return self.verification.status != "failed" and not any(
            finding.severity == "error" for finding in self.remaining
        )

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

    input_shapes: fixed dimensions for dynamic graph inputs, {name: [d0, d1, ...]}.
    verify: compare the two models' outputs in ONNX Runtime; when the outputs differ
        the fixed model is not written and FixError is raised.
    """
    resolved = resolve_targets(targets)
    original = load_model(in_path)
    shapes = {name: [int(d) for d in dims] for name, dims in (input_shapes or {}).items()}
    _check_input_names(original, shapes)
    before = check(original, resolved)

    applied: list[Rewrite] = []
    model = _fold_constants(original, shapes, applied)
    model = _integer_shape_arithmetic(model, applied)
    model = _convert_opset(model, resolved, applied)
    onnx.checker.check_model(model)

    verification = (
        _compare_in_onnxruntime(original, model, shapes)
        if verify
        else Verification("skipped", "not asked for")
    )
    if verification.status == "failed":
        raise FixError(
            f"the fixed model's outputs differ from the original's ({verification.reason}); "
            f"nothing was written to {out_path}"
        )
    write_atomically(out_path, lambda temporary: onnx.save(model, str(temporary)))
    return FixResult(
        input_path=str(in_path),
        output_path=str(out_path),
        targets=[target.name for target in resolved],
        applied=applied,
        before=before,
        remaining=check(model, resolved),
        verification=verification,
    )


def _check_input_names(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> None:
    names = {graph_input.name for graph_input in model.graph.input}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise BladesmithError(
            f"input_shapes names {unknown}, which are not graph inputs; inputs are {sorted(names)}"
        )


# -- 1. constant folding ----------------------------------------------------------------


def _fold_constants(
    model: onnx.ModelProto, shapes: dict[str, list[int]], applied: list[Rewrite]
) -> onnx.ModelProto:
    """onnxslim's constant folding, dead-node and common-subexpression elimination. Its
    pattern fusions (Conv+BN, Gemm, ...) are skipped: they are optimisations, not fixes."""
    import onnxslim

    before = [node.name for node in model.graph.node]
    folded = onnxslim.slim(
        onnx.ModelProto.FromString(model.SerializeToString()),
        input_shapes=[f"{name}:{','.join(map(str, dims))}" for name, dims in shapes.items()]
        or None,
        skip_optimizations=["graph_fusion", "weight_tying"],
    )
    if folded is None:
        raise FixError("onnxslim could not simplify the model")
    after = {node.name for node in folded.graph.node}
    removed = tuple(name for name in before if name and name not in after)
    if shapes:
        fixed = ", ".join(f"{name}={dims}" for name, dims in shapes.items())
        applied.append(Rewrite("static-input-shapes", (), f"input shapes fixed: {fixed}"))
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


# -- 2. float shape arithmetic as integers -----------------------------------------------
#
# Pattern: x (int64/int32) -> Cast(to=float) -> [Mul|Add|Sub by an integer-valued
# constant, Neg, Floor|Ceil|Round, Div by a positive integer followed by Floor or Ceil]*
# -> Cast(to=int). Every intermediate value is then an integer, so Floor/Ceil/Round are
# identities and the chain equals the same arithmetic done in x's integer type; Div
# needs x >= 0 (true of dimensions read by Shape/Size) for integer division to be the
# floor. Exact while the float values are exact integers: below 2**24 for float32, which
# every tensor dimension is in practice (above it the float original was already off).


@dataclass(frozen=True)
class _Step:
    # integer op: "Mul" | "Add" | "Sub" | "SubFrom" (constant - x) | "Neg" | "FloorDiv" |
    # "CeilDiv" | "Identity" (Floor/Ceil/Round of an integer)
    op: str
    constant: np.ndarray | None
    nodes: tuple[onnx.NodeProto, ...]


def _integer_shape_arithmetic(model: onnx.ModelProto, applied: list[Rewrite]) -> onnx.ModelProto:
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
    return model


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
    producer = view.producer.get(cast.input[0])
    non_negative = producer is not None and producer.op_type in ("Shape", "Size")
    steps: list[_Step] = []
    current = cast.output[0]
    while True:
        consumers = view.consumers.get(current, [])
        if len(consumers) != 1 or current in view.graph_output_names:
            return None
        node = consumers[0]
        if node.op_type == "Cast":
            return (steps, node) if attribute(node, "to") in _INTEGER_TYPES else None
        if node.op_type in ("Floor", "Ceil", "Round"):
            steps.append(_Step("Identity", None, (node,)))
        elif node.op_type == "Neg":
            steps.append(_Step("Neg", None, (node,)))
            non_negative = False
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
    consumers = view.consumers.get(tensor, [])
    if len(consumers) != 1 or tensor in view.graph_output_names:
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


# -- 3. opset conversion ------------------------------------------------------------------


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


# -- 4. verification and saving -----------------------------------------------------------


def _compare_in_onnxruntime(
    original: onnx.ModelProto, fixed: onnx.ModelProto, shapes: dict[str, list[int]]
) -> Verification:
    import onnxruntime as ort

    from bladesmith.verify import compare_tensors

    try:
        feeds = synthesise_inputs(original, shapes)
    except ValueError as error:
        return Verification("skipped", str(error))
    runs = []
    for model in (original, fixed):
        try:
            session = ort.InferenceSession(
                model.SerializeToString(), providers=["CPUExecutionProvider"]
            )
            runs.append(session.run(None, feeds))
        except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
            return Verification("skipped", f"ONNX Runtime CPU cannot run the model: {error}")
    names = [output.name for output in original.graph.output]
    verification = Verification("passed")
    for name, reference, candidate in zip(names, *runs, strict=True):
        comparison = compare_tensors(reference, candidate)
        verification.outputs[name] = comparison.summary()
        if not comparison.passed:
            verification.status = "failed"
            verification.reason = f"output {name}: {comparison.summary()}"
    return verification


def synthesise_inputs(
    model: onnx.ModelProto, shapes: Mapping[str, list[int]] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs for every graph input; ValueError names an input whose shape is not
    fixed (neither static in the model nor given in `shapes`)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        tensor_type = graph_input.type.tensor_type
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
