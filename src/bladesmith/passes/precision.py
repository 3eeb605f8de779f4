"""fp16 and bf16: run the model in half precision, kept only if the outputs stay close.

The model's floating-point parameters and buffers (a TorchScript model's too), and its
floating-point inputs, are cast to the half type; its floating-point outputs are cast
back to float32, so callers see the dtype they had. bf16 (wider range, fewer mantissa
bits) is tried only when fp16 was not kept, for models whose activations overflow fp16.

A traced TorchScript model can hold its dtypes as constants (``mean.to(x.dtype)``
traced on float32 inputs casts to float32 for good), so its half weights then meet
float32 activations. Such a model runs under ``torch.autocast`` instead, which chooses
each operator's precision as it is called, whatever the graph says. Tracing drops
autocast, so its ``.pt`` save runs in float32 (as accurate, not as fast).
"""

from __future__ import annotations

import copy
import functools
from typing import ClassVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes.onnxruntime import SUFFIX as ONNX_SUFFIX
from bladesmith.runtimes.torchscript import is_torchscript
from bladesmith.verify import dtype_name, precisions


class CastFloats(nn.Module):
    """``module`` running in ``dtype``: casts floating inputs to it, outputs to ``output_dtype``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, output_dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.dtype = dtype
        self.output_dtype = output_dtype

    def forward(self, *args, **kwargs):
        args, kwargs = pytree.tree_map(lambda x: _cast(x, self.dtype), (args, kwargs))
        return pytree.tree_map(lambda x: _cast(x, self.output_dtype), self.module(*args, **kwargs))


class AutocastFloats(CastFloats):
    """``module`` called under ``torch.autocast`` in ``dtype``; outputs cast to
    ``output_dtype``. Its weights and inputs stay as they are."""

    def forward(self, *args, **kwargs):
        device_type = _device_type((args, kwargs))
        with torch.autocast(device_type, dtype=self.dtype):
            outputs = self.module(*args, **kwargs)
        return pytree.tree_map(lambda x: _cast(x, self.output_dtype), outputs)


def _device_type(tree) -> str:
    tensors = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    return tensors[0].device.type if tensors else "cpu"


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


NO_CPU_BF16 = "this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX): slower than float32"
# bladesmith runs and checks a saved .onnx in ONNX Runtime on the CPU.
BFLOAT16_PASSES = ("bf16", "roi_heads_bf16", "linear_bf16")
NO_ONNX_BF16 = {
    ONNX_SUFFIX: "ONNX Runtime's CPU kernels (and ONNX's Conv) take no bfloat16: to save "
    f".onnx, optimize with the bfloat16 passes excluded (Config(exclude={BFLOAT16_PASSES!r}) "
    f"or Config(save_as='.onnx'); bladesmith optimize --out MODEL.onnx, or "
    f"{' '.join(f'--exclude {name}' for name in BFLOAT16_PASSES)})"
}


class Float16(Pass):
    """Half precision (fp16) weights and activations, gated by the accuracy check."""

    name = "fp16"
    levels = ("o1", "o2")
    devices = ("cuda",)  # CPUs have no fp16 matrix units: it is slower there
    changes_precision = True
    computes_in = precisions.FLOAT16

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if candidate.dtype != torch.float32:
            return f"the model computes in {dtype_name(candidate.dtype)}, not float32"
        if not any(p.is_floating_point() for p in candidate.module.parameters()):
            return "the model has no floating-point parameters"
        return _nms_problem(candidate.module, self.computes_in.dtype, context.device)

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        dtype = self.computes_in.dtype
        module = copy.deepcopy(candidate.module).to(dtype)
        wrapped = CastFloats(module, dtype, output_dtype=candidate.dtype)
        example = candidate.runner_args(context.example_args)
        if is_torchscript(candidate.module) and _fails(wrapped, example):
            context.notes.append(
                f"{self.name}: the TorchScript model keeps float32 casts in its graph, so "
                f"{self.name} is tried under torch.autocast (a .pt save of it runs in float32)"
            )
            wrapped = AutocastFloats(candidate.module, dtype, candidate.dtype)
        return candidate.with_module(wrapped, self.name, dtype=dtype)


class BFloat16(Float16):
    """bfloat16 weights and activations, tried when fp16 was not kept (overflow, accuracy,
    or a CPU); on a CPU only where it computes in bfloat16 natively."""

    name = "bf16"
    computes_in = precisions.BFLOAT16
    devices = ("cuda", "cpu")
    refuses_formats = NO_ONNX_BF16

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if Float16.name in context.kept:
            return "fp16 was kept; bf16 is tried only when fp16 is not"
        if context.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(context.device)} has no bf16 support"
        if context.device.type == "cpu" and not cpu_has_bf16():
            return NO_CPU_BF16
        return super().skip_reason(candidate, context)


class _PartsInBFloat16(Pass):
    """Some layers alone in bfloat16 (``parts``, each converted in place), on CPUs
    that compute in it, where bf16 for the whole model was not kept; ``missing`` says
    why a model without any is skipped."""

    levels = ("o1", "o2")
    devices = ("cpu",)
    changes_precision = True
    computes_in = precisions.BFLOAT16
    rewrites_modules = True
    refuses_formats = NO_ONNX_BF16

    missing: ClassVar[str]

    def parts(self, module: nn.Module) -> list:
        raise NotImplementedError

    def convert(self, part) -> None:
        """One of ``parts`` in bfloat16, in place."""
        raise NotImplementedError

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if not cpu_has_bf16():
            return NO_CPU_BF16
        if candidate.dtype != torch.float32:
            return f"the model computes in {dtype_name(candidate.dtype)}, not float32"
        return None if self.parts(candidate.module) else self.missing

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        for part in self.parts(module):
            self.convert(part)
        return candidate.with_module(module, self.name, dtype=self.computes_in.dtype)


class RoIHeadsBFloat16(_PartsInBFloat16):
    """A two-stage detector's RoI heads (the box head and predictor, a mask or keypoint
    head and predictor: every layer that runs once per region) in bfloat16: they take
    most of the CPU time (Faster R-CNN v2's four 3x3 convolutions per proposal), and their
    rounding does not move the proposals. The fixed-shape pipeline names them
    (``roi_heads``, a tuple of attribute names); in a torchvision detector that
    fixed_shape did not convert (Keypoint R-CNN, say) they are torchvision's RoIHeads'
    own heads, which it calls as layers."""

    name = "roi_heads_bf16"
    missing = "the model has no RoI heads (a two-stage detector's)"

    def parts(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return _roi_heads(module)

    def convert(self, part: tuple[nn.Module, str]) -> None:
        parent, name = part
        setattr(parent, name, in_bfloat16(getattr(parent, name)))


# torchvision's RoIHeads: the layers it calls once per region (None when absent).
_TORCHVISION_HEADS = (
    "box_head",
    "box_predictor",
    "mask_head",
    "mask_predictor",
    "keypoint_head",
    "keypoint_predictor",
)


def _roi_heads(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of each per-region layer in ``module``: those a pipeline
    names in ``roi_heads`` (a tuple of names; torchvision's detectors hold a module under
    that name), and those of each torchvision RoIHeads."""
    from torchvision.models.detection.roi_heads import RoIHeads

    found = []
    for parent in module.modules():
        names = getattr(parent, "roi_heads", None)
        if isinstance(parent, RoIHeads):
            names = [n for n in _TORCHVISION_HEADS if getattr(parent, n, None) is not None]
        elif not isinstance(names, tuple):
            continue
        found.extend((parent, name) for name in names)
    return found


class LinearBFloat16(_PartsInBFloat16):
    """The Linear layers alone in bfloat16: a detector's box head, a transformer's MLPs,
    where most of the time goes, at the cost of their rounding only (Faster R-CNN
    MobileNetV3 on two cores: 1.8x eager, F1 1 against float32, where bf16 everywhere
    failed the gate).

    Each layer is converted where it is (``linear_in_bfloat16``), not wrapped: parents
    read their layers' weights. nn.MultiheadAttention's ``out_proj`` is left in float32:
    the attention multiplies by its weight itself, with float32 activations."""

    name = "linear_bf16"
    missing = "the model has no Linear layer (outside attention's out_proj)"

    def parts(self, module: nn.Module) -> list[nn.Linear]:
        return _linear_layers(module)

    def convert(self, part: nn.Linear) -> None:
        linear_in_bfloat16(part)


def _linear_layers(module: nn.Module) -> list[nn.Linear]:
    """The Linear layers of ``module`` that are called as layers (not those whose weights
    an nn.MultiheadAttention reads)."""
    inside_attention = {
        id(child)
        for parent in module.modules()
        if isinstance(parent, nn.MultiheadAttention)
        for child in parent.children()
    }
    return [
        m for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in inside_attention
    ]


def linear_in_bfloat16(layer: nn.Linear) -> nn.Linear:
    """``layer`` (of a copy: converted in place) computing in bfloat16, its inputs cast in
    and its outputs back to float32 by hooks. It stays an nn.Linear where it was, with its
    ``weight``: nn.TransformerEncoderLayer's fused inference path reads
    ``linear1.weight`` itself, and takes the path that calls its layers (so the casts
    run) when a submodule has hooks."""
    layer.to(torch.bfloat16)
    layer.register_forward_pre_hook(_inputs_to_bfloat16, with_kwargs=True)
    layer.register_forward_hook(_outputs_to_float32)
    return layer


def _inputs_to_bfloat16(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return pytree.tree_map(lambda x: _cast(x, torch.bfloat16), (args, kwargs))


def _outputs_to_float32(module: nn.Module, args: tuple, outputs):
    return pytree.tree_map(lambda x: _cast(x, torch.float32), outputs)


def in_bfloat16(layer: nn.Module) -> CastFloats:
    """``layer`` of a float32 model (converted in place: a copy's) computing in bfloat16:
    its inputs cast in, its outputs cast back to float32."""
    return CastFloats(layer.to(torch.bfloat16), torch.bfloat16, torch.float32)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX tiles), where
    oneDNN's bfloat16 convolutions and matrix products beat float32's (2.2x and 2.5x on
    two cores of a Xeon with AVX512-BF16); elsewhere bfloat16 is emulated, and slower."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def _nms_problem(module: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``module`` cast to ``dtype`` would fail on ``device``: a torchvision detector's
    own post-processing (it is not a fixed-shape pipeline) calls torchvision's nms on
    boxes of the network's dtype, and nms may have no kernel for it (bfloat16 on a CPU)."""
    from torchvision.models.detection import FCOS, RetinaNet
    from torchvision.models.detection.roi_heads import RoIHeads
    from torchvision.models.detection.rpn import RegionProposalNetwork
    from torchvision.models.detection.ssd import SSD

    kinds = (RegionProposalNetwork, RoIHeads, RetinaNet, FCOS, SSD)
    caller = next((m for m in module.modules() if isinstance(m, kinds)), None)
    if caller is None or _nms_has_kernel(dtype, str(device)):
        return None
    return (
        f"torchvision's nms has no {dtype_name(dtype)} kernel on the {device.type}, and the "
        f"model's {type(caller).__name__} would call it on {dtype_name(dtype)} boxes (a "
        "fixed-shape pipeline, and the passes that convert some layers alone, keep "
        "post-processing in float32)"
    )


@functools.cache
def _nms_has_kernel(dtype: torch.dtype, device: str) -> bool:
    """Whether torchvision's nms runs on ``dtype`` boxes on ``device`` (torchvision 0.2x
    has no bfloat16 kernel on a CPU)."""
    from torchvision.ops import nms

    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=dtype, device=device)
    try:
        nms(boxes, boxes[:, 2], 0.5)
    except RuntimeError:
        return False
    return True


def _fails(module: nn.Module, args: tuple) -> bool:
    """Whether ``module`` raises on ``args`` (a dtype mismatch inside the graph)."""
    try:
        with torch.no_grad():
            module(*args)
    except RuntimeError:
        return True
    return False
