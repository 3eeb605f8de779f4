"""fp8: linear layers in float8 on GPUs with FP8 tensor cores (compute capability 8.9+).

Each ``nn.Linear`` whose sizes FP8 matrix products take (both multiples of 16) becomes a
``Float8Linear``: its weight stored once in float8 e4m3 with one scale for the tensor,
its input scaled by its own absolute maximum at each call (dynamic, per tensor) and cast
to e4m3, and the product run by ``torch._scaled_mm`` into the input's dtype, bias added
there. Run eagerly, that scaling costs more than FP8 saves (0.44x of fp16 on an H100), so
the pass runs after ``inductor`` and compiles its module as that pass does: Inductor
fuses each input's scaling into the layer before it, and the result, timed against the
best so far (compiled where Inductor was kept), saves as a ``.ptc``. An
``nn.MultiheadAttention``, which reads its projections' weights itself, first becomes a
``ProjectedAttention`` (the same self-attention with its projections as Linear layers), so
that its projections, about a third of a transformer's matrix work, run in FP8 too.
Everything that is not a Linear (the user's and bladesmith's operators among it) stays as
it is.

e4m3 keeps 3 mantissa bits: outputs move by far more than rounding, so the result
computes in ``precisions.FLOAT8`` and is judged by the task's metric on held-out inputs
(top-1 agreement for a classifier; ``Config(metric=...)`` for anything else), as int8 is.
Where it fails, ``fp8_mixed`` ranks the layers by how far FP8 in each alone moves the
outputs and keeps the most sensitive as they were until the metric holds on calibration
inputs (as NNCF's accuracy control and ModelOpt's auto-quantize do). Where ``fp8`` is not
kept, ``fp8_static`` scales each input by its range over the calibration inputs, set once:
no reduction over the input at each call (on an H100 the dynamic form ran ViT-B/16 at
0.90x of fp16). Part of level o2, or ``Config(include=["fp8"])``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.inductor import Inductor, compiled
from bladesmith.passes.layer_inputs import watch_inputs
from bladesmith.passes.projected_attention import attention_names, with_projected_attention
from bladesmith.passes.registry import Context, Pass, PassSkipped
from bladesmith.verify import precisions, task_metric

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
_ALIGN = 16  # what torch._scaled_mm asks of a product's inner and outer sizes
# (major, minor) from which a GPU has FP8 tensor cores: Ada (8.9), Hopper (9.0)
FP8_CAPABILITY = (8, 9)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale that maps ``amax`` to e4m3's largest value (1 where it is 0)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as e4m3 values and the scale (a float32 scalar) that gives it back."""
    scale = _scale_of(x.detach().abs().amax())
    return _scaled(x, scale), scale


def _scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at its largest value."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


class Float8Linear(nn.Module):
    """``linear`` with an e4m3 weight (one scale) and its input cast to e4m3 at each call:
    scaled by its own absolute maximum, or by ``input_amax`` (static: calibrated once;
    larger inputs saturate)."""

    def __init__(self, linear: nn.Linear, input_amax: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = to_e4m3(linear.weight.detach())
        # [out, in] row-major: its transpose is the column-major operand _scaled_mm takes
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        static = None if input_amax is None else _scale_of(input_amax).to(weight.device)
        self.register_buffer("input_scale", static)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_scale is None:
            values, scale = to_e4m3(rows)
        else:  # no reduction over the input: Inductor fuses the cast into the layer before
            values, scale = _scaled(rows, self.input_scale), self.input_scale
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = torch._scaled_mm(
            values,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=bias,
            out_dtype=x.dtype,
            # Hopper's faster, less exact accumulation, as torchao's inference configs
            # take it: the metric judges the result either way.
            use_fast_accum=True,
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scaling = "dynamic" if self.input_scale is None else "static"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, {scaling}"


def convertible(module: nn.Module) -> list[str]:
    """The names of the Linear layers that FP8 takes in ``module`` with its attention
    projected (``with_projected_attention``): sizes multiples of 16, called as modules
    (not inside an ``nn.MultiheadAttention``, which reads their weight)."""
    inside_attention = {
        f"{name}.{child}" if name else child
        for name, each in module.named_modules()
        if isinstance(each, nn.MultiheadAttention)
        for child, _ in each.named_modules()
        if child
    }
    sizes = {
        name: (each.in_features, each.out_features)
        for name, each in module.named_modules()
        if type(each) in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)
        and name not in inside_attention
    }
    for name in attention_names(module):  # in_proj packs the queries, keys and values
        width = module.get_submodule(name).embed_dim
        prefix = f"{name}." if name else ""
        sizes |= {f"{prefix}in_proj": (width, 3 * width), f"{prefix}out_proj": (width, width)}
    return [
        name
        for name, (inputs, outputs) in sizes.items()
        if inputs % _ALIGN == 0 and outputs % _ALIGN == 0
    ]


def to_float8(
    module: nn.Module, names: list[str], input_amax: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    """A copy of ``module`` with its attention projected and the Linear layers ``names``
    as ``Float8Linear``, static where ``input_amax`` gives the layer's input's absolute
    maximum."""
    module = with_projected_attention(module)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        amax = (input_amax or {}).get(name)
        setattr(parent, child, Float8Linear(getattr(parent, child), amax))
    return module


def input_amax(module: nn.Module, names: list[str], calls: list[tuple]) -> dict:
    """The absolute maximum of the input of each layer of ``names`` over ``calls``; a
    layer that none of them reaches is absent."""
    found: dict[str, torch.Tensor] = {}
    if attention_names(module):  # its projections' names exist once projected (a copy)
        module = with_projected_attention(module)
    named = {module.get_submodule(name): name for name in names}

    def record(layer, args):
        name, amax = named[layer], args[0].detach().abs().amax().float()
        found[name] = torch.maximum(found[name], amax) if name in found else amax

    watch_inputs(module, named, calls, record)
    return found


class Float8(Pass):
    """Linear layers in float8 e4m3 (dynamic per-tensor scales) on FP8 GPUs (o2)."""

    name = "fp8"
    levels = ("o2",)
    devices = ("cuda",)
    changes_precision = True
    computes_in = precisions.FLOAT8
    rewrites_modules = True
    refuses_formats = {
        ".pt": "a TorchScript file cannot hold it (its loader's checks have no float8 "
        "kernels); save it as .ptc",
        ".onnx": "the ONNX export has no float8 type; save it as .ptc",
    }

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        capability = torch.cuda.get_device_capability(context.device)
        if capability < FP8_CAPABILITY:
            return (
                f"{torch.cuda.get_device_name(context.device)} (compute capability "
                f"{capability[0]}.{capability[1]}) has no FP8 tensor cores; they start at "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} (Ada, Hopper)"
            )
        if not convertible(candidate.module):
            return "the model has no Linear layer FP8 takes (sizes multiples of 16)"
        if candidate.backend not in ("eager", Inductor.name):
            return f"it compiles the module with Inductor; this result runs {candidate.backend}"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        names = convertible(candidate.module)
        context.notes.append(
            f"{self.name}: {len(names)} Linear layer(s) in float8 e4m3, the rest as they "
            "were, compiled by Inductor"
        )
        return in_float8(candidate, names, self.name, context)


def in_float8(
    candidate: Candidate, names: list[str], name: str, context: Context, amax=None
) -> Candidate:
    """``candidate`` with the Linear layers ``names`` in FP8 (pass ``name``; static
    where ``amax`` gives their inputs' range), compiled."""
    module = to_float8(candidate.module, names, amax)
    return compiled(candidate.with_module(module, name, precision=precisions.FLOAT8), context)


class Float8Static(Float8):
    """fp8 with each input's scale calibrated once, where fp8 was not kept (o2): no
    reduction over the input at each call."""

    name = "fp8_static"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if Float8.name in context.kept:
            return f"{Float8.name} was kept"
        return super().skip_reason(candidate, context)

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        calls, how = context.calibration_calls(candidate)
        names = convertible(candidate.module)
        amax = input_amax(candidate.module, names, calls)
        context.notes.append(
            f"{self.name}: {len(amax)} Linear layer(s) in float8 e4m3 with their input's "
            f"scale calibrated on {how}, {len(names) - len(amax)} scaled at each call "
            "(no calibration input reached them), compiled by Inductor"
        )
        return in_float8(candidate, names, self.name, context, amax)


class Float8Mixed(Float8):
    """fp8 with the layers it breaks kept as they were, where fp8 failed its metric (o2)."""

    name = "fp8_mixed"

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        for each in (Float8.name, Float8Static.name):
            if each in context.kept:
                return f"{each} was kept: every layer holds the metric in float8"
        return super().skip_reason(candidate, context)

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        calls, how = context.calibration_calls(candidate)
        names = convertible(candidate.module)
        with context.step(f"ranking {len(names)} Linear layers by their FP8 error"):
            kept = layers_to_keep(candidate.module, names, calls, context.config)
        context.notes.append(
            f"{self.name}: {len(kept)} of {len(names)} Linear layer(s) kept as they were to "
            f"hold the metric on {how}: {', '.join(kept)}"
        )
        chosen = [name for name in names if name not in kept]
        return in_float8(candidate, chosen, self.name, context)


def layers_to_keep(module: nn.Module, names: list[str], calls: list[tuple], config) -> list[str]:
    """The fewest of ``names`` to keep out of FP8, most sensitive first (how far FP8 in
    that layer alone moves ``module``'s outputs on ``calls``), for the task's metric on
    ``calls`` to hold against ``module``'s own outputs there. Raises ``PassSkipped``
    where all of them hold it, or where no choice does."""
    with torch.no_grad():
        expected = [module(*each) for each in calls]

        def outputs(chosen: list[str]) -> list:
            converted = to_float8(module, chosen)
            return [converted(*each) for each in calls]

        def holds(kept: int) -> bool:
            verdict = task_metric.judge(expected, outputs(ranked[kept:]), calls, config)
            if isinstance(verdict, str):
                raise PassSkipped(f"not judged on the calibration inputs: {verdict}")
            return verdict.passed

        error = {name: _moved(expected, outputs([name])) for name in names}
        ranked = sorted(names, key=error.get, reverse=True)
        if holds(0):
            raise PassSkipped(
                "every Linear layer holds the metric in float8 on the calibration inputs: "
                "nothing to keep as it was"
            )
        if not holds(len(ranked) - 1):
            raise PassSkipped(
                "the metric fails on the calibration inputs even with only the least "
                f"sensitive layer ({ranked[-1]}) in float8"
            )
        low, high = 0, len(ranked) - 1  # fails with low kept, holds with high kept
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if holds(middle) else (middle, high)
    return ranked[:high]


def _moved(expected: list, got: list) -> float:
    """How far ``got`` moved from ``expected``: the relative norm of the difference of
    their floating-point tensors, all calls together."""
    pairs = [
        (x.float(), y.float())
        for x, y in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got), strict=True)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    difference = sum(float((y - x).norm() ** 2) for x, y in pairs)
    return (difference / max(sum(float(x.norm() ** 2) for x, _ in pairs), 1e-30)) ** 0.5
