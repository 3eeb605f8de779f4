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

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes.onnxruntime import cpu_runner, export_onnx
from bladesmith.spec import ONNX_SUFFIX


class OnnxRuntime(Pass):
    """ONNX export + ONNX Runtime session (CPU execution provider)."""

    name = "onnxruntime"
    devices = ("cpu",)
    saves_as = ONNX_SUFFIX

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed (pip install onnxruntime)"
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
