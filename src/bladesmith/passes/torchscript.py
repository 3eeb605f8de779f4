"""torchscript: trace, freeze and optimize for inference (CPU; and a TorchScript
model's own route on the GPU).

Freezing inlines the parameters as constants, which lets TorchScript fold
convolution + batch norm, drop dropout, and pre-pack weights for oneDNN
(``runtimes.torchscript``). A model given as TorchScript is frozen as it is (after the
precision and memory-format passes, which change its parameters): on the GPU too, where
Inductor, which cannot read TorchScript, compiles the nn.Modules instead.
"""

from __future__ import annotations

import torch

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.precision import AutocastFloats, CastFloats
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes.torchscript import SUFFIX as TORCHSCRIPT_SUFFIX
from bladesmith.runtimes.torchscript import freeze, is_torchscript, quiet_torchscript


class TorchScriptFreeze(Pass):
    """TorchScript trace + freeze + optimize_for_inference (CPU; TorchScript models: GPU too)."""

    name = "torchscript"
    saves_as = TORCHSCRIPT_SUFFIX

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if context.device.type != "cpu" and not is_torchscript(candidate.module):
            return "on the GPU, Inductor compiles nn.Modules; this is for TorchScript models"
        if _eager_torchvision_detector(candidate.module):
            return (
                "torchvision's detector keeps as many detections as each image has, which a "
                "trace would freeze at the test image's count; its fixed-shape pipeline "
                "(the fixed_shape pass) traces"
            )
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        example = candidate.runner_args(context.example_args)
        module, cast = candidate.module, None
        if isinstance(module, CastFloats) and is_torchscript(module.module):
            # The precision passes' cast around a TorchScript model stays outside: a trace
            # of it would drop autocast, and hold a list or dict input (handed on to the
            # TorchScript model) as a constant.
            module, cast = module.module, module
        with context.step("tracing and freezing with TorchScript"):
            frozen = freeze(module, example)
            with quiet_torchscript():
                if isinstance(cast, AutocastFloats):  # freezing folds; optimize_for_inference's
                    # oneDNN and fused cuDNN convolutions are operators autocast does not cast
                    runner = AutocastFloats(frozen, cast.dtype, cast.output_dtype)
                else:
                    runner = torch.jit.optimize_for_inference(frozen)
                    if cast is not None:
                        runner = CastFloats(runner, cast.dtype, cast.output_dtype)
                with torch.no_grad():
                    runner(*example)  # the profiling executor specialises on first runs
        return candidate.with_runner(runner, self.name)


def _eager_torchvision_detector(module) -> bool:
    from torchvision.models.detection.fcos import FCOS
    from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
    from torchvision.models.detection.retinanet import RetinaNet
    from torchvision.models.detection.ssd import SSD

    return isinstance(module, (FCOS, SSD, GeneralizedRCNN, RetinaNet))
