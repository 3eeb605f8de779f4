"""ONNX Runtime: a module exported to ONNX and run in a session on the CPU, the runner
that the onnxruntime pass builds and that ``.onnx`` artifacts hold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch.utils import _pytree as pytree


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
