"""Which operators a target implements, and the rules that use it.

The list comes from the installed ONNX Runtime's kernel registry where that build
includes the provider (always the CPU one), otherwise from operator_support.json, which
this package ships: ONNX Runtime's generated OperatorKernels.md for the CUDA and DirectML
providers and onnx-tensorrt's operator matrix for TensorRT. Each finding says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import onnx

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
class OperatorList:
    """Kernels of one provider: (domain, op) -> inclusive (first, last) schema versions."""

    provider: str
    source: str
    kernels: dict[tuple[str, str], tuple[tuple[int, int], ...]]

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(domain for domain, _ in self.kernels)

    @property
    def max_opset(self) -> int:
        """The newest default-domain schema version with a kernel."""
        return max(first for (domain, _), ranges in self.kernels.items() if domain == ""
                   for first, _last in ranges)  # fmt: skip

    def supports(self, domain: str, op_type: str, since_version: int) -> bool:
        if domain == "" and op_type in _WITHOUT_KERNEL and not self.provider.startswith("Tensor"):
            return True
        ranges = self.kernels.get((domain, op_type), ())
        return any(first <= since_version <= last for first, last in ranges)


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
            kernels[(_normal_domain(domain), op_type)] = ((first, last),)
    source = f"{entry['source']}; bladesmith {DATA_FILE.name} {data['data_version']}"
    return OperatorList(provider, source, kernels)


def _installed_kernels(provider: str) -> OperatorList | None:
    import onnxruntime
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    kernels: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for kernel in ort_state.get_all_opkernel_def():
        if kernel.provider == provider:
            key = (_normal_domain(kernel.domain), kernel.op_name)
            kernels.setdefault(key, []).append(tuple(kernel.version_range))
    if not kernels:
        return None
    source = f"kernel registry of the installed onnxruntime {onnxruntime.__version__}"
    return OperatorList(provider, source, {key: tuple(v) for key, v in kernels.items()})


def _normal_domain(domain: str) -> str:
    return "" if domain in STANDARD_DOMAINS else domain


def since_version(op_type: str, domain: str, opset: int) -> int:
    """The schema version a node of `op_type` resolves to under `opset` (1 when the
    schema is unknown to onnx, as for ONNX Runtime's contrib operators)."""
    try:
        return onnx.defs.get_schema(op_type, opset, domain).since_version
    except onnx.defs.SchemaError:
        return 1


def unsupported_operators(view: GraphView, target: Target) -> list[Finding]:
    """Standard or ONNX Runtime operators that the target does not implement."""
    supported = operator_list(target.kernel_source)
    cpu = operator_list("CPUExecutionProvider") if target.cpu_fallback else None
    opsets = {_normal_domain(entry.domain): entry.version for entry in view.model.opset_import}
    findings = []
    for node in view.all_nodes():
        domain = _normal_domain(node.domain)
        if domain != "" and domain not in supported.domains:
            continue  # a custom domain: custom_operators() reports it
        version = since_version(node.op_type, domain, opsets.get(domain, 1))
        if supported.supports(domain, node.op_type, version):
            continue
        name = f"{node.domain + '::' if domain else ''}{node.op_type}-{version}"
        if cpu is not None and cpu.supports(domain, node.op_type, version):
            severity = "warning"
            message = f"{name} has no {target.kernel_source} kernel; it runs on the CPU"
            hint = "expect device-host copies around it; replace it with supported ops"
        else:
            severity = "error"
            message = f"{name} is not implemented by {target.title}"
            hint = (
                "rewrite it with supported operators, or export at an opset whose "
                "version of it is supported"
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


def custom_operators(view: GraphView, target: Target) -> list[Finding]:
    """Operators of a domain the target has no kernels for: they need a library."""
    known = operator_list(target.kernel_source).domains | {""}
    if target.trt_shape_rules:
        hint = "register a TensorRT plugin of this name (IPluginCreator) before building"
    else:
        hint = (
            "register the op's library: SessionOptions.register_custom_ops_library(path) "
            "(onnxruntime_extensions.get_library_path() for ai.onnx.contrib)"
        )
    return [
        Finding(
            rule=CUSTOM_RULE,
            severity="warning",
            target=target.name,
            node=view.label(node),
            message=f"{node.domain}::{node.op_type} is a custom operator; "
            f"{target.title} runs it only with a registered implementation",
            hint=hint,
            source=operator_list(target.kernel_source).source,
        )
        for node in view.all_nodes()
        if _normal_domain(node.domain) not in known
    ]


RULES = (unsupported_operators, custom_operators)
