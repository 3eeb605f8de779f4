"""Deployment targets that `bladesmith check` knows, and what each one requires.

A target is where an ONNX model is meant to run: an ONNX Runtime execution provider or a
TensorRT engine. The facts below come from each vendor's documentation; docs/onnx.md
gives the sources and what to do about each rule. Operator lists,
opset ranges and restrictions are data: rules/operator_support.json, rules/restrictions.json.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from bladesmith.errors import BladesmithError


class UnknownTargetError(BladesmithError, ValueError):
    """A target name that `bladesmith check` does not know; the message lists the known ones."""


@dataclass(frozen=True)
class Target:
    """What one deployment target accepts.

    name: the id used on the command line.
    kernel_source: whose operator list decides "implemented": an ONNX Runtime provider
        name, or "TensorRT10"/"TensorRT8" for the TensorRT ONNX parser.
    cpu_fallback: an operator the target lacks runs on ONNX Runtime's CPU provider
        instead (a slowdown, not a failure).
    trt_shape_rules: TensorRT's shape-tensor rules apply (values that feed shapes are
        computed at build time by shape layers, never by plugins).
    static_dims: severity of a dynamic input dimension ("" when the target does not care).
    int64_narrowed: the target stores INT64 as INT32 (TensorRT 8).
    zero_dims: severity of a tensor dimension that can be zero ("" when handled).
    providers: ONNX Runtime execution providers, in priority order, to run on it.
    session_options: SessionOptions attributes the provider needs.
    """

    name: str
    title: str
    kernel_source: str
    cpu_fallback: bool
    trt_shape_rules: bool
    static_dims: str
    int64_narrowed: bool
    zero_dims: str
    providers: tuple[str, ...]
    session_options: dict = field(default_factory=dict)


TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target(
            name="tensorrt",
            title="TensorRT 10 (ONNX parser)",
            kernel_source="TensorRT10",
            cpu_fallback=False,
            trt_shape_rules=True,
            static_dims="info",
            int64_narrowed=False,
            zero_dims="warning",
            providers=(
                "TensorrtExecutionProvider",
                "CUDAExecutionProvider",
                "CPUExecutionProvider",
            ),
        ),
        Target(
            name="tensorrt8",
            title="TensorRT 8.5/8.6 (ONNX parser)",
            kernel_source="TensorRT8",
            cpu_fallback=False,
            trt_shape_rules=True,
            static_dims="info",
            int64_narrowed=True,
            zero_dims="warning",
            providers=(
                "TensorrtExecutionProvider",
                "CUDAExecutionProvider",
                "CPUExecutionProvider",
            ),
        ),
        Target(
            name="directml",
            title="ONNX Runtime DirectML (Windows, DirectX 12)",
            kernel_source="DmlExecutionProvider",
            cpu_fallback=True,
            trt_shape_rules=False,
            static_dims="warning",
            int64_narrowed=False,
            zero_dims="warning",
            providers=("DmlExecutionProvider", "CPUExecutionProvider"),
            # The DirectML provider supports neither memory patterns nor parallel
            # execution; a session created with either fails.
            session_options={"enable_mem_pattern": False, "execution_mode": "sequential"},
        ),
        Target(
            name="ort-cpu",
            title="ONNX Runtime CPU",
            kernel_source="CPUExecutionProvider",
            cpu_fallback=False,
            trt_shape_rules=False,
            static_dims="",
            int64_narrowed=False,
            zero_dims="",
            providers=("CPUExecutionProvider",),
        ),
        Target(
            name="ort-cuda",
            title="ONNX Runtime CUDA",
            kernel_source="CUDAExecutionProvider",
            cpu_fallback=True,
            trt_shape_rules=False,
            static_dims="",
            int64_narrowed=False,
            zero_dims="",
            providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
        ),
    )
}


def resolve_targets(targets: str | Target | Iterable[str | Target]) -> list[Target]:
    """Targets from names ("tensorrt", "directml,ort-cpu", "all") or Target objects."""
    if isinstance(targets, (str, Target)):
        targets = [targets]
    resolved: list[Target] = []
    for item in targets:
        if isinstance(item, Target):
            names = [item]
        elif item.strip() == "all":
            names = list(TARGETS.values())
        else:
            names = [_lookup(part.strip()) for part in item.split(",") if part.strip()]
        resolved.extend(target for target in names if target not in resolved)
    if not resolved:
        raise UnknownTargetError(f"no target given; choose from {', '.join(TARGETS)} or 'all'")
    return resolved


def _lookup(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise UnknownTargetError(
            f"unknown target {name!r}; choose from {', '.join(TARGETS)} or 'all'"
        ) from None
