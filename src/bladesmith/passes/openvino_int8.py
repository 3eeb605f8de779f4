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

import dataclasses
import importlib.util
import logging

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.openvino import OpenVino
from bladesmith.passes.registry import Context, PassSkipped
from bladesmith.runtimes import openvino
from bladesmith.runtimes.built_for import tensors_in
from bladesmith.verify import precisions

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
        calibration, how = context.calibration()
        if not calibration:
            raise PassSkipped("no calibration inputs (Config.calibration_data)")
        args = candidate.runner_args(context.example_args)
        pipeline = [candidate.runner_args(each) for each in calibration]
        with context.step("converting to OpenVINO IR"):
            model, output_spec, dtypes = openvino.convert(candidate.module, args)
        logging.getLogger("nncf").setLevel(logging.WARNING)  # its progress bars and notes
        with context.step(f"calibrating INT8 ranges on {len(pipeline)} inputs"):
            dataset = nncf.Dataset(
                pipeline, lambda each: [x.detach().cpu().numpy() for x in tensors_in(each)]
            )
            quantized = nncf.quantize(model, dataset, subset_size=len(pipeline))
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
