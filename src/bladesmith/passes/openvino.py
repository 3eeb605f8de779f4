"""openvino: convert to OpenVINO IR and compile for the CPU (OpenVINO's own kernels,
graph fusions and memory planning, often the fastest CPU runtime for convolutions).

The module (or its family's fixed-shape pipeline) is converted by OpenVINO's PyTorch
frontend on the example's inputs and compiled with ``Config.openvino_hint`` (latency by
default), ``openvino_threads`` and ``openvino_streams``. OpenVINO picks its inference
precision itself: bf16 on a CPU with bf16 instructions. The ``openvino`` pass runs in
that precision and says so (its result's dtype is what OpenVINO reports it compiled
in, and the engine's tolerance follows); ``openvino_f32`` asks for f32, for where the
default moved the outputs past tolerance. A module calling bladesmith's operators (a
detector's fixed-shape pipeline: decode, NMS, RoI pooling) is converted from
bladesmith's ONNX export with them lowered to standard operators, NMS to ONNX's
NonMaxSuppression, which OpenVINO runs as its own; so is one calling the user's
operators registered with a lowering (``bladesmith.onnx.register_op`` with
``onnxscript=`` or ``symbolic=``). Any other operator the converter has no rule for
skips the pass, naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from bladesmith.ops import libraries
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes import openvino
from bladesmith.runtimes.formats import FORMATS
from bladesmith.verify import precisions
from bladesmith.verify.precisions import Precision

# Namespaces whose operators OpenVINO's PyTorch frontend converts.
_CONVERTED = ("aten", "prim", "torchvision", "quantized")


@functools.cache
def default_precision() -> str:
    """The precision OpenVINO's CPU plugin computes in unless told otherwise."""
    return openvino.precision_name(
        openvino.core().get_property(openvino.DEVICE, "INFERENCE_PRECISION_HINT")
    )


class OpenVino(Pass):
    """OpenVINO IR compiled for the CPU (latency hint), in OpenVINO's default precision."""

    name = "openvino"
    devices = ("cpu",)
    saves_as = openvino.SUFFIX
    changes_precision = True  # bf16 where the CPU has it
    refuses_formats = {
        suffix: "the model runs in OpenVINO; saved so it would run another way, slower than "
        f"what was measured: save it as {openvino.SUFFIX}"
        for suffix in FORMATS
        if suffix != openvino.SUFFIX
    }
    precision: str | None = None  # INFERENCE_PRECISION_HINT asked for; None: OpenVINO's

    @property
    def computes_in(self) -> Precision | None:
        precision = self.precision or _installed_default()
        dtype = openvino.PRECISIONS.get(precision) if precision else None
        return None if dtype in (None, torch.float32) else precisions.of_dtype(dtype)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        missing = openvino.FORMAT.missing_package()
        if missing:
            return missing
        if candidate.dtype != torch.float32:
            return (
                f"a {str(candidate.dtype).removeprefix('torch.')} pass was kept: OpenVINO "
                "converts a float32 model and picks its own precision"
            )
        from bladesmith.onnx.exporter import held_constants

        args = candidate.runner_args(context.example_args)
        baked = held_constants(candidate.module, args)
        if baked:
            return (
                f"the test data passes non-tensor arguments ({', '.join(baked)}), which the "
                "conversion would hold as constants"
            )
        foreign = [op for op in not_converted(candidate.module, args) if not openvino.lowered(op)]
        if foreign:
            return (
                f"OpenVINO's PyTorch converter has no rule for {', '.join(foreign)}, and "
                "it has no lowering to standard ONNX (bladesmith.onnx.register_op with "
                "onnxscript= or symbolic= gives one)"
            )
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        config = context.config
        chosen = openvino.settings(
            config.openvino_hint, config.openvino_threads, config.openvino_streams, self.precision
        )
        args = candidate.runner_args(context.example_args)
        lowered = not_converted(candidate.module, args)  # all lowered: skip_reason
        route = "through ONNX, " + ", ".join(lowered) + " lowered" if lowered else "from torch"
        with context.step(f"converting to OpenVINO IR ({route})"):
            runner = openvino.runner_for(candidate.module, args, chosen, via_onnx=bool(lowered))
        if lowered:
            context.notes.append(
                f"{self.name} converted the model {route} to standard ONNX operators "
                "(OpenVINO's PyTorch converter has no rule for them)"
            )
        with context.step("compiling for the CPU"):
            runner(*args)
        used = runner.used()
        context.notes.append(
            f"{self.name} compiled with "
            + ", ".join(f"{name}={value}" for name, value in used.items())
            + " (Config.openvino_hint, openvino_threads, openvino_streams)"
        )
        dtype = openvino.PRECISIONS.get(used["INFERENCE_PRECISION_HINT"], torch.float32)
        return dataclasses.replace(candidate.with_runner(runner, self.name), dtype=dtype)


class OpenVinoF32(OpenVino):
    """OpenVINO IR compiled for the CPU in f32, where its default precision is lower."""

    name = "openvino_f32"
    changes_precision = False
    precision = "f32"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if candidate.backend == OpenVino.name:
            return "the openvino pass was kept in OpenVINO's default precision"
        default = _installed_default()
        if default == "f32":
            return "OpenVINO computes in f32 here by default: the openvino pass tried it"
        return super().skip_reason(candidate, context)


def not_converted(module, args: tuple) -> list[str]:
    """The operators ``module`` calls that OpenVINO's PyTorch converter has no rule for."""
    called = libraries.all_operators_called(module, args)
    return sorted(op for op in called if op.partition("::")[0] not in _CONVERTED)


def _installed_default() -> str | None:
    return default_precision() if importlib.util.find_spec(openvino.PACKAGE) else None
