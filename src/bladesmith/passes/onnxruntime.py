"""onnxruntime: export to ONNX and run with ONNX Runtime (CPU).

ONNX Runtime's graph optimisations (constant folding, conv + activation fusion, its
own MLAS kernels and memory planning) often beat eager PyTorch on small CPUs. The
bladesmith operators are exported as custom-domain nodes that call the same CPU
kernels (``bladesmith.onnx.export(custom_ops="domain")``).

The result stays a drop-in for any batch size: the first dimension of every input is
exported free, and the session is tried on a batch twice the example's against the
model itself. A model whose graph fixes its batch (a reshape to a traced constant) fails
that check; it is exported again, with fixed shapes, for each new input shape it meets.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
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
        return pytree.tree_unflatten(
            list(self.session(*_tensors((args, kwargs)))), self.output_spec
        )


class OnnxRunnerPerShape:
    """ONNX Runtime sessions of a module whose export fixes its shapes: one per input
    shape, exported from the module the first time that shape comes."""

    def __init__(self, module, example_args: tuple, runner: OnnxRunner, build: Callable):
        self.module, self.build = module, build
        self.runners = {_shapes(example_args): runner}

    def __call__(self, *args, **kwargs):
        shapes = _shapes((args, kwargs))
        if shapes not in self.runners:
            self.runners[shapes] = self.build(self.module, args, dynamic_batch=False)
        return self.runners[shapes](*args, **kwargs)


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _shapes(tree) -> tuple:
    return tuple(tuple(tensor.shape) for tensor in _tensors(tree))


def export_onnx(module, args: tuple, path: Path, dynamic_batch: bool = True) -> pytree.TreeSpec:
    """Export ``module`` called on ``args`` to ``path``; return its output structure.

    With ``dynamic_batch`` the first dimension of every tensor input is left free.
    The bladesmith operators become custom-domain nodes running their CPU kernels when
    onnxruntime-extensions is installed, else standard ONNX operators."""
    from bladesmith import onnx

    with torch.no_grad():
        output_spec = pytree.tree_flatten(module(*args))[1]
    custom_ops = "domain" if importlib.util.find_spec("onnxruntime_extensions") else "standard"
    tensors = _tensors(args)
    names = [f"input_{index}" for index in range(len(tensors))]
    dynamic = {name: {0: "batch"} for name, x in zip(names, tensors, strict=True) if x.dim()}
    onnx.export(
        module,
        args,
        path,
        custom_ops=custom_ops,
        input_names=names,
        dynamic_axes=dynamic if dynamic_batch else None,
    )
    return output_spec


def cpu_runner(path: Path, output_spec: pytree.TreeSpec) -> OnnxRunner:
    """An ONNX Runtime session on the CPU, as many threads as torch uses."""
    from bladesmith import onnx

    session = onnx.session(path, device="cpu", threads=torch.get_num_threads())
    return OnnxRunner(session, output_spec)


def onnx_runner(module, args: tuple, dynamic_batch: bool = True) -> OnnxRunner:
    """``module`` exported on ``args`` and loaded in an ONNX Runtime CPU session."""
    with tempfile.TemporaryDirectory(prefix="bladesmith-onnx-") as directory:
        path = Path(directory) / "model.onnx"
        output_spec = export_onnx(module, args, path, dynamic_batch=dynamic_batch)
        return cpu_runner(path, output_spec)


def follows_the_batch(runner: Callable, module, args: tuple) -> bool:
    """Whether ``runner`` gives ``module``'s outputs on a batch twice ``args``'s: same
    structure and shapes, values within a bound far wider than rounding and far tighter
    than a graph that kept its example's batch (it fails or repeats the wrong items)."""
    doubled = pytree.tree_map(
        lambda x: torch.cat([x, x.flip(0)]) if isinstance(x, torch.Tensor) and x.dim() else x,
        args,
    )
    try:
        with torch.no_grad():
            expected, got = (
                pytree.tree_flatten(module(*doubled)),
                pytree.tree_flatten(runner(*doubled)),
            )
    except Exception:  # ONNX Runtime refuses the shape: the export fixed it
        return False
    if expected[1] != got[1]:
        return False
    for want, have in zip(expected[0], got[0], strict=True):
        if isinstance(want, torch.Tensor):
            if not isinstance(have, torch.Tensor) or want.shape != have.shape:
                return False
            if want.is_floating_point():
                scale = want.abs().max().item() if want.numel() else 0.0
                if not torch.allclose(have.to(want), want, rtol=1e-3, atol=1e-3 * scale):
                    return False
            elif not torch.equal(have.to(want), want):
                return False
    return True


@register
class OnnxRuntime(Pass):
    """ONNX export + ONNX Runtime session (CPU execution provider), any batch size."""

    name = "onnxruntime"
    devices = ("cpu",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed (pip install onnxruntime)"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module, args = candidate.module, candidate.runner_args(context.example_args)
        with context.step("exporting to ONNX, the batch dimension free"):
            runner = onnx_runner(module, args)
        with context.step("checking the ONNX Runtime session on a batch twice as large"):
            follows = follows_the_batch(runner, module, args)
        if not follows:
            with context.step("exporting to ONNX, shapes fixed"):
                static = onnx_runner(module, args, dynamic_batch=False)
            runner = OnnxRunnerPerShape(module, args, static, onnx_runner)
            context.notes.append(
                "onnxruntime: the export does not follow the batch size; each new input "
                "shape is exported again on its first call"
            )
        return candidate.with_runner(runner, self.name)
