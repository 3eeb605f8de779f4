"""Which operators a target implements, and the rules that use it.

The list comes from the installed ONNX Runtime's kernel registry where that build
includes the provider (always the CPU one): opset ranges, type constraints and the schema
versions ONNX Runtime itself resolves. Otherwise it comes from operator_support.json,
which this package ships: ONNX Runtime's generated OperatorKernels.md for the CUDA and
DirectML providers and onnx-tensorrt's operator matrix for TensorRT. Each finding says
which. For ONNX Runtime providers a node without a kernel is judged the way ONNX Runtime
runs it: an ONNX function operator by its function body, float16 on the CPU in float32.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import onnx

from bladesmith.onnx import custom_nodes
from bladesmith.onnx.rules.finding import Finding
from bladesmith.onnx.rules.graph import STANDARD_DOMAINS, GraphView
from bladesmith.onnx.targets import Target

UNSUPPORTED_RULE = "unsupported-op"
CUSTOM_RULE = "custom-op"

DATA_FILE = Path(__file__).with_name("operator_support.json")
_OPEN_END = 2**31 - 1
# ONNX Runtime turns these into initializers or graph plumbing: no kernel is registered.
_WITHOUT_KERNEL = frozenset({"Constant"})


@dataclass(frozen=True)
class Kernel:
    """One registered kernel: the schema versions it covers and, where the source says
    (ONNX Runtime's registry does, the documentation tables do not), the types it takes
    per type parameter."""

    first: int
    last: int
    types: Mapping[str, frozenset[str]] | None = None

    def covers(self, version: int) -> bool:
        return self.first <= version <= self.last

    def accepts(self, bound: Mapping[str, set[str]]) -> bool:
        """Whether every type bound to a constrained parameter is one it takes."""
        return self.types is None or all(
            bound[param] <= allowed for param, allowed in self.types.items() if param in bound
        )


@dataclass(frozen=True)
class OperatorList:
    """Kernels of one provider: (domain, op) -> its kernels."""

    provider: str
    source: str
    kernels: dict[tuple[str, str], tuple[Kernel, ...]]
    # (domain, op) -> the schema versions the provider's runtime knows, oldest first;
    # None: resolve versions with the installed onnx (lists from documentation).
    schemas: dict[tuple[str, str], tuple[int, ...]] | None = None

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(domain for domain, _ in self.kernels)

    @property
    def max_opset(self) -> int:
        """The newest default-domain schema version with a kernel."""
        return max(kernel.first for (domain, _), kernels in self.kernels.items() if domain == ""
                   for kernel in kernels)  # fmt: skip

    def since_version(self, domain: str, op_type: str, opset: int) -> int | None:
        """The schema version a node resolves to under `opset` in this provider's runtime,
        None when the runtime does not know the operator."""
        if self.schemas is None:
            found = schema(op_type, domain, opset)
            return 1 if found is None else found.since_version
        versions = [v for v in self.schemas.get((domain, op_type), ()) if v <= opset]
        return max(versions) if versions else None

    def kernels_for(self, domain: str, op_type: str, since_version: int) -> tuple[Kernel, ...]:
        if domain == "" and op_type in _WITHOUT_KERNEL and not self.provider.startswith("Tensor"):
            return (Kernel(1, _OPEN_END),)
        return tuple(k for k in self.kernels.get((domain, op_type), ()) if k.covers(since_version))

    def supports(self, domain: str, op_type: str, since_version: int) -> bool:
        return bool(self.kernels_for(domain, op_type, since_version))


@cache
def operator_list(provider: str) -> OperatorList:
    """The operators `provider` implements, from the installed onnxruntime if it has the
    provider, else from the shipped data file."""
    installed = _installed_kernels(provider)
    if installed is not None:
        return installed
    data = json.loads(DATA_FILE.read_text())
    entry = data["providers"].get(provider)
    if entry is None:
        raise KeyError(f"no operator list for {provider!r} in {DATA_FILE.name}")
    kernels = {}
    for domain, operators in entry["operators"].items():
        for op_type, versions in operators.items():
            first, last = versions if isinstance(versions, list) else (versions, _OPEN_END)
            kernels[(_normal_domain(domain), op_type)] = (Kernel(first, last),)
    source = f"{entry['source']}; bladesmith {DATA_FILE.name} {data['data_version']}"
    return OperatorList(provider, source, kernels)


def _installed_kernels(provider: str) -> OperatorList | None:
    import onnxruntime
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    kernels: dict[tuple[str, str], list[Kernel]] = {}
    for kernel in ort_state.get_all_opkernel_def():
        if kernel.provider == provider:
            key = (_normal_domain(kernel.domain), kernel.op_name)
            types = {
                param: frozenset(allowed) for param, allowed in kernel.type_constraints.items()
            }
            first, last = kernel.version_range
            # ONNX Runtime matches an open-ended kernel only to the schema version it
            # starts at (kernel_registry.cc); a newer schema needs a new registration.
            kernels.setdefault(key, []).append(
                Kernel(first, first if last >= _OPEN_END else last, types)
            )
    if not kernels:
        return None
    schemas: dict[tuple[str, str], list[int]] = {}
    for entry in ort_state.get_all_operator_schema():
        schemas.setdefault((_normal_domain(entry.domain), entry.name), []).append(
            entry.since_version
        )
    source = f"kernel registry of the installed onnxruntime {onnxruntime.__version__}"
    return OperatorList(
        provider,
        source,
        {key: tuple(v) for key, v in kernels.items()},
        {key: tuple(sorted(v)) for key, v in schemas.items()},
    )


def _normal_domain(domain: str) -> str:
    return "" if domain in STANDARD_DOMAINS else domain


@cache
def onnx_domains() -> frozenset[str]:
    """Domains onnx defines operators in (the default one, ai.onnx.ml, the preview ones)."""
    return frozenset(_normal_domain(schema.domain) for schema in onnx.defs.get_all_schemas())


def schema(op_type: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    """The schema a node of `op_type` resolves to under `opset`, None when onnx does not
    know it (as for ONNX Runtime's contrib operators)."""
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


def unsupported_operators(view: GraphView, target: Target) -> list[Finding]:
    """Operators (with their element types, where the kernel list has them) that the
    target does not implement. ONNX Runtime runs an ONNX function operator without a
    kernel as its function body, so for its providers the body's nodes decide."""
    supported = operator_list(target.kernel_source)
    cpu = operator_list("CPUExecutionProvider") if target.cpu_fallback else None
    expand = not target.kernel_source.startswith("TensorRT")
    findings = []
    for node in view.all_nodes():
        reason = missing_kernel(view, node, supported, expand)
        if reason is None:
            continue
        if cpu is not None and missing_kernel(view, node, cpu, expand) is None:
            severity = "warning"
            message = f"{reason} in {target.kernel_source}; it runs on the CPU"
            hint = "expect device-host copies around it; replace it with supported ops"
        else:
            severity = "error"
            message = f"{reason}: {target.title} cannot run it"
            hint = (
                "rewrite it with supported operators or types, or export at an opset "
                "whose version of it is supported"
            )
        findings.append(
            Finding(
                rule=UNSUPPORTED_RULE,
                severity=severity,
                target=target.name,
                node=view.label(node),
                message=message,
                hint=hint,
                source=supported.source,
            )
        )
    return findings


def missing_kernel(
    view: GraphView, node: onnx.NodeProto, supported: OperatorList, expand: bool, depth: int = 0
) -> str | None:
    """Why `supported` has no kernel for the node ("Add-14 has no kernel for T=
    tensor(bfloat16)"), None when it has one or the node is a custom operator."""
    domain = _normal_domain(node.domain)
    if domain not in supported.domains | onnx_domains():
        return None  # a custom domain: custom_operators() reports it
    opset = view.opsets.get(domain, 1)
    version = supported.since_version(domain, node.op_type, opset)
    qualified = f"{node.domain}::{node.op_type}" if domain else node.op_type
    if version is None:
        return f"{qualified} (opset {opset}) is an operator {supported.provider} does not know"
    name = f"{qualified}-{version}"
    kernels = supported.kernels_for(domain, node.op_type, version)
    found = schema(node.op_type, domain, opset)
    if kernels:
        bound = bound_types(view, node, found)
        if any(kernel.accepts(bound) for kernel in kernels):
            return None
        if supported.provider == "CPUExecutionProvider" and _runs_as_float(bound, kernels):
            return None
        reason = f"{name} has no kernel for {_describe(bound, kernels)}"
    elif supported.schemas is None:
        reason = f"{name} is not in its operator list"
    else:
        reason = f"{name} has no kernel"
    if not expand or depth >= _MAX_FUNCTION_DEPTH or not _expandable(found, opset):
        return reason
    body = function_body(view, node)
    if body is None:
        return None  # a function onnx cannot expand here (types unknown): benefit of doubt
    inner = [
        why
        for body_node in body.all_nodes()
        if (why := missing_kernel(body, body_node, supported, expand, depth + 1))
    ]
    if not inner:
        return None
    return f"{reason}, and its ONNX function body has none either ({inner[0]})"


def _expandable(found: onnx.defs.OpSchema | None, opset: int) -> bool:
    """Whether the operator has a function body valid at `opset`. A body written for an
    older opset is rejected (by onnx, so by ONNX Runtime) when an operator it uses got a
    new version since: Swish's body of opset 24 is not used at opset 25, where CastLike
    changed."""
    if found is None:
        return False
    if found.has_context_dependent_function:
        return True
    versions = [v for v in found.function_opset_versions if v <= opset]
    if not versions:
        return False
    written_for = max(versions)
    body = onnx.FunctionProto.FromString(found.get_function_with_opset_version(written_for))
    return all(
        (used := schema(n.op_type, _normal_domain(n.domain), opset)) is None
        or used.since_version <= written_for
        for n in body.node
    )


def bound_types(
    view: GraphView, node: onnx.NodeProto, found: onnx.defs.OpSchema | None
) -> dict[str, set[str]]:
    """Type parameter -> the types of the node's inputs and outputs bound to it (those
    whose types are known)."""
    bound: dict[str, set[str]] = {}
    if found is None:
        return bound
    for formals, actuals in ((found.inputs, node.input), (found.outputs, node.output)):
        for index, name in enumerate(actuals):
            if not formals or not name:
                continue
            formal = formals[min(index, len(formals) - 1)]
            if index >= len(formals) and formal.option != _VARIADIC:
                continue
            type_str = view.type_string(name)
            if type_str is not None:
                bound.setdefault(formal.type_str, set()).add(type_str)
    return bound


def _runs_as_float(bound: dict[str, set[str]], kernels: tuple[Kernel, ...]) -> bool:
    """ONNX Runtime's CPU provider runs a float16 node without a float16 kernel in float32,
    between the Casts it inserts (InsertCastTransformer)."""
    widened = {
        param: {"tensor(float)" if t == "tensor(float16)" else t for t in types}
        for param, types in bound.items()
    }
    return widened != bound and any(kernel.accepts(widened) for kernel in kernels)


def _describe(bound: dict[str, set[str]], kernels: tuple[Kernel, ...]) -> str:
    constrained = {param for kernel in kernels for param in (kernel.types or {})}
    return ", ".join(
        f"{param}={'|'.join(sorted(types))}"
        for param, types in sorted(bound.items())
        if param in constrained
    )


_VARIADIC = onnx.defs.OpSchema.FormalParameterOption.Variadic
_MAX_FUNCTION_DEPTH = 4


def function_body(view: GraphView, node: onnx.NodeProto) -> GraphView | None:
    """The node expanded into its ONNX function body (as onnx's inliner, like ONNX
    Runtime, expands it for the node's input types), None when onnx cannot expand it."""
    import onnx.inliner

    inputs = [_value_info(view, name) for name in dict.fromkeys(node.input) if name]
    outputs = [onnx.ValueInfoProto(name=name) for name in node.output if name]
    graph = onnx.helper.make_graph([node], "function", inputs, outputs)
    single = onnx.helper.make_model(graph, opset_imports=list(view.model.opset_import))
    single.ir_version = view.model.ir_version or onnx.IR_VERSION
    try:
        inlined = onnx.inliner.inline_selected_functions(
            single, [(node.domain, node.op_type)], inline_schema_functions=True
        )
    except Exception:  # onnx's C++ inliner raises plain RuntimeErrors/ValueErrors
        return None
    if [(n.domain, n.op_type) for n in inlined.graph.node] == [(node.domain, node.op_type)]:
        return None  # left as it was: the inliner needs types it does not have
    return GraphView(inlined)


def _value_info(view: GraphView, name: str) -> onnx.ValueInfoProto:
    info = onnx.ValueInfoProto(name=name)
    type_proto = view.type_proto(name)
    if type_proto is not None:
        info.type.CopyFrom(type_proto)
    return info


def custom_operators(view: GraphView, target: Target) -> list[Finding]:
    """Operators of a domain the target has no kernels for: they need a library."""
    known = operator_list(target.kernel_source).domains | onnx_domains()
    # The user's custom nodes, as the file lists them (ONNX Runtime targets).
    users = {
        (custom_nodes.DOMAIN, entry["op_type"]): entry
        for entry in ([] if target.trt_shape_rules else custom_nodes.listed(view.model))
    }
    return [
        _users_kernel(view, node, target, users[node.domain, node.op_type])
        if (node.domain, node.op_type) in users
        else _bladesmiths_kernel(view, node, target)
        if (node.domain, node.op_type) in _BLADESMITH_NODES
        else _registered_kernel(view, node, target)
        for node in view.all_nodes()
        if _normal_domain(node.domain) not in known
    ]


def _custom_finding(view: GraphView, node, target: Target, severity: str, **text) -> Finding:
    """A finding of ``CUSTOM_RULE`` on ``node``; ``text``: its message, hint and source."""
    return Finding(
        rule=CUSTOM_RULE, severity=severity, target=target.name, node=view.label(node), **text
    )


def _registered_kernel(view: GraphView, node, target: Target) -> Finding:
    """Any other custom node: the target runs it with an implementation registered."""
    return _custom_finding(
        view,
        node,
        target,
        "warning",
        message=f"{node.domain}::{node.op_type} is a custom operator; "
        f"{target.title} runs it only with a registered implementation",
        hint=_library_hint(node.domain, target),
        source=operator_list(target.kernel_source).source,
    )


_BLADESMITH_NODES = frozenset((custom_nodes.DOMAIN, t) for t in custom_nodes.OP_TYPES.values())


def _library_hint(domain: str, target: Target) -> str:
    if target.trt_shape_rules:
        return "register a TensorRT plugin of this name (IPluginCreator) before building"
    if domain == custom_nodes.DOMAIN:  # onnxruntime-extensions' own operators
        return (
            "register onnxruntime-extensions' library: SessionOptions."
            "register_custom_ops_library(onnxruntime_extensions.get_library_path())"
        )
    return "register the op's library: SessionOptions.register_custom_ops_library(path)"


def _bladesmiths_kernel(view: GraphView, node, target: Target) -> Finding:
    """A node of bladesmith's own operators (``custom_ops="domain"``): onnxruntime-extensions'
    library does not have it; bladesmith.onnx.session registers its kernel there first."""
    return _custom_finding(
        view,
        node,
        target,
        "warning",
        message=f"{node.domain}::{node.op_type} is bladesmith's operator (custom_ops='domain'), "
        "which only bladesmith.onnx.session runs (its CPU kernel, registered with "
        f"onnxruntime-extensions), not {target.title} alone",
        hint=f"for {target.title}, export standard ONNX: bladesmith export onnx MODEL OUT "
        "--custom-ops standard (bladesmith.onnx.export(..., custom_ops='standard'))",
        source="bladesmith's operators (bladesmith.onnx.custom_nodes.OP_TYPES)",
    )


def _users_kernel(view: GraphView, node, target: Target, entry: dict) -> Finding:
    """A custom node of the user's operator (``entry``: the file's list): its code is the
    operator's PyTorch kernel or the ``ort_impl`` registered for it, which no ONNX Runtime
    has; only bladesmith.onnx.session registers it, in a process that has the code."""
    operator = entry["operator"]
    code = (
        f"the PyTorch kernel of {operator}, which {target.title} has only inside "
        "bladesmith.onnx.session with the operator's library loaded"
        if entry["ort_impl"] == custom_nodes.DEFAULT_IMPL
        else f"the ort_impl registered for {operator}, which {target.title} has only inside "
        "bladesmith.onnx.session after that register_op call"
    )
    return _custom_finding(
        view,
        node,
        target,
        "error",
        message=f"{node.domain}::{node.op_type} runs {code}",
        hint=f'for ONNX Runtime alone, export it as standard ONNX: register_op("{operator}", '
        "onnxscript=...) and custom_ops='standard'",
        source=f"the file's {custom_nodes.METADATA_KEY} metadata (bladesmith.onnx.export)",
    )


RULES = (unsupported_operators, custom_operators)
