"""openvino_int8: post-training INT8 by NNCF, compiled by OpenVINO for the CPU.

The module is converted to OpenVINO IR as the ``openvino`` pass converts it, and NNCF's
``quantize`` inserts INT8 quantize/dequantize pairs (per-channel weights, per-tensor
activations, ranges set on ``Context.calibration``'s inputs: ``Config.calibration_data``,
or inputs derived from the test data that no verdict uses); OpenVINO then runs the
convolutions and matrix products in INT8. Its result computes in ``precisions.INT8``,
judged by the task's metric on held-out inputs (``verify.task_metric``), not by a
tensor tolerance. It is part of level o2 (or ``Config(include=["openvino_int8"])``).
An operator OpenVINO cannot convert (the user's, bladesmith's) skips the pass, named,
as it skips ``openvino``: nothing of the model is left unconverted to keep in float.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging

import torch
from torch.utils import _pytree as pytree

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.openvino import OpenVino, not_converted
from bladesmith.passes.registry import Context, PassSkipped
from bladesmith.runtimes import openvino
from bladesmith.runtimes.built_for import tensors_in
from bladesmith.verify import precisions, task_metric

PACKAGE = "nncf"


class OpenVinoInt8(OpenVino):
    """INT8 by NNCF's post-training quantization, run by OpenVINO on the CPU (o2)."""

    name = "openvino_int8"
    levels = ("o2",)
    computes_in = precisions.INT8
    precision = None  # OpenVINO's own for what stays in float

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if importlib.util.find_spec(PACKAGE) is None:
            return (
                "needs the nncf package, which is not installed: pip install 'bladesmith[openvino]'"
            )
        return super().skip_reason(candidate, context)

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        import nncf

        config = context.config
        pipeline, how = context.calibration_calls(candidate)
        args = candidate.runner_args(context.example_args)
        lowered = not_converted(candidate.module, args)  # all lowered: skip_reason
        with context.step("converting to OpenVINO IR"):
            model, output_spec, dtypes = openvino.convert(
                candidate.module, args, via_onnx=bool(lowered)
            )
        logging.getLogger("nncf").setLevel(logging.WARNING)  # its notes
        dataset = nncf.Dataset(pipeline, _arrays)
        # NNCF draws its own progress bars on stdout, which is the user's: the step says it.
        with context.step(f"calibrating INT8 ranges on {len(pipeline)} inputs"):
            with contextlib.redirect_stdout(io.StringIO()):
                quantized = self.quantize(model, dataset, candidate, pipeline, context)
        chosen = openvino.settings(
            config.openvino_hint, config.openvino_threads, config.openvino_streams, None
        )
        runner = openvino.OpenVinoRunner(quantized, chosen, output_spec, dtypes)
        with context.step("compiling for the CPU"):
            runner(*args)
        context.notes.append(
            f"{self.name}: calibrated on {how}; judged on the held-out inputs, never these"
        )
        return dataclasses.replace(
            candidate.with_runner(runner, self.name), precision=precisions.INT8
        )

    def quantize(self, model, dataset, candidate: Candidate, pipeline: list, context: Context):
        """The OpenVINO model with INT8 quantize/dequantize pairs inserted."""
        import nncf

        return nncf.quantize(model, dataset, subset_size=len(pipeline))


class OpenVinoInt8Mixed(OpenVinoInt8):
    """INT8 with the layers it breaks kept in float, where whole INT8 failed its metric."""

    name = "openvino_int8_mixed"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if OpenVinoInt8.name in context.kept:
            return f"{OpenVinoInt8.name} was kept: every layer holds the metric in INT8"
        return super().skip_reason(candidate, context)

    def quantize(self, model, dataset, candidate: Candidate, pipeline: list, context: Context):
        """NNCF's accuracy control: the layers ranked by how far quantizing them moves
        the outputs, the worst returned to float until the task's metric on the
        calibration inputs (against the module's own outputs there) holds its bar; the
        engine's verdict is still on the held-out inputs."""
        import nncf

        with torch.no_grad():
            expected = [candidate.module(*each) for each in pipeline]
        _, output_spec = pytree.tree_flatten(expected[0])
        verdicts = []

        def validate(compiled, indices) -> tuple[float, None]:
            indices = list(indices)  # of pipeline's calls: NNCF hands back the raw items
            got = [_outputs(compiled, pipeline[i], output_spec) for i in indices]
            # Against the module's outputs on the same calls: NNCF validates the float
            # model too, which then agrees with itself.
            reference = [expected[i] for i in indices]
            inputs = [pipeline[i] for i in indices]
            verdict = task_metric.judge(reference, got, inputs, context.config)
            verdicts.append(verdict)
            return (0.0 if isinstance(verdict, str) else verdict.value), None

        validation = nncf.Dataset(list(range(len(pipeline))), lambda i: _arrays(pipeline[i]))
        full = nncf.quantize(model, dataset, subset_size=len(pipeline))
        mixed = nncf.quantize_with_accuracy_control(
            model,
            dataset,
            validation,
            validate,
            max_drop=_max_drop(context.config),
            subset_size=len(pipeline),
        )
        kept_float = sorted(_quantized_ops(full) - _quantized_ops(mixed))
        if not kept_float:
            raise PassSkipped(
                "NNCF's accuracy control returned every layer in INT8 on the calibration "
                f"inputs{_on_all_calls(verdicts)}: nothing to keep in float"
            )
        context.notes.append(
            f"{self.name}: {len(kept_float)} layer(s) kept in float to hold the metric "
            f"on the calibration inputs: {', '.join(kept_float)}"
        )
        return mixed


def _arrays(each) -> list:
    return [x.detach().cpu().numpy() for x in tensors_in(each)]


def _outputs(compiled, args: tuple, output_spec):
    """A compiled OpenVINO model's outputs on ``args``, in the module's structure."""
    results = compiled(_arrays(args))
    leaves = [torch.from_numpy(results[i].copy()) for i in range(len(compiled.outputs))]
    return pytree.tree_unflatten(leaves, output_spec)


def _max_drop(config) -> float:
    return config.max_drop if config.max_drop is not None else task_metric.TOP1_MAX_DROP


def _on_all_calls(verdicts: list) -> str:
    """The last verdict over all the calibration inputs (NNCF also validates subsets:
    the last one may count a single call)."""
    judged = [each for each in verdicts if not isinstance(each, str)]
    widest = max((each.count for each in judged), default=0)
    last = next((each for each in reversed(judged) if each.count == widest), None)
    return f" ({last.line})" if last is not None else ""


def _quantized_ops(model) -> set[str]:
    """The operations whose inputs an INT8 quantizer feeds (by their friendly names)."""
    names = set()
    for op in model.get_ops():
        if op.get_type_name() != "FakeQuantize":
            continue
        for target in op.output(0).get_target_inputs():
            node = target.get_node()
            # "__module.features.0/aten::_convolution/Convolution": the module's path
            path = node.get_friendly_name().split("/")[0].removeprefix("__module.")
            names.add(f"{path} ({node.get_type_name()})")
    return names
