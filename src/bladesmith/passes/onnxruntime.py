"""onnxruntime: export to ONNX and run with ONNX Runtime (CPU).

ONNX Runtime's graph optimisations (constant folding, conv + activation fusion, its
own MLAS kernels and memory planning) often beat eager PyTorch on small CPUs. The
bladesmith operators are exported as custom-domain nodes that call the same CPU
kernels (``bladesmith.onnx.export(custom_ops="domain")``).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, register


class OnnxRunner:
    """An ONNX Runtime session called like the module it was exported from: tensor
    arguments in, the module's output structure out (as CPU tensors)."""

    def __init__(self, session, output_spec):
        self.session = session
        self.output_spec = output_spec

    def __call__(self, *args, **kwargs):
        inputs = [
            leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
        ]
        return pytree.tree_unflatten(list(self.session(*inputs)), self.output_spec)


def export_onnx(module, args: tuple, path: Path) -> pytree.TreeSpec:
    """Export ``module`` called on ``args`` to ``path``; return its output structure.

    The bladesmith operators become custom-domain nodes running their CPU kernels when
    onnxruntime-extensions is installed, else standard ONNX operators."""
    from bladesmith import onnx

    with torch.no_grad():
        output_spec = pytree.tree_flatten(module(*args))[1]
    custom_ops = "domain" if importlib.util.find_spec("onnxruntime_extensions") else "standard"
    onnx.export(module, args, path, custom_ops=custom_ops)
    return output_spec


def cpu_runner(path: Path, output_spec: pytree.TreeSpec) -> OnnxRunner:
    """An ONNX Runtime session on the CPU, as many threads as torch uses."""
    from bladesmith import onnx

    session = onnx.session(path, device="cpu", threads=torch.get_num_threads())
    return OnnxRunner(session, output_spec)


@register
class OnnxRuntime(Pass):
    """ONNX export + ONNX Runtime session (CPU execution provider)."""

    name = "onnxruntime"
    devices = ("cpu",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed (pip install onnxruntime)"
        from bladesmith.onnx import user_ops

        untranslated = sorted(
            op for op in context.user_operators if user_ops.translation(op) is None
        )
        if untranslated:
            return (
                f"{', '.join(untranslated)} has no ONNX translation "
                f"({user_ops.REGISTER_CALL} gives one)"
            )
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        args = candidate.runner_args(context.example_args)
        with tempfile.TemporaryDirectory(prefix="bladesmith-onnx-") as directory:
            path = Path(directory) / "model.onnx"
            with context.step("exporting to ONNX"):
                output_spec = export_onnx(candidate.module, args, path)
            with context.step("creating the ONNX Runtime session"):
                runner = cpu_runner(path, output_spec)
        return candidate.with_runner(runner, self.name)
