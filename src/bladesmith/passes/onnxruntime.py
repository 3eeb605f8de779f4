"""onnxruntime: export to ONNX and run with ONNX Runtime (CPU).

ONNX Runtime's graph optimisations (constant folding, conv + activation fusion, its
own MLAS kernels and memory planning) often beat eager PyTorch on small CPUs. The
bladesmith operators are exported as custom-domain nodes that call the same CPU
kernels (``bladesmith.onnx.export(custom_ops="domain")``).

The result stays a drop-in for any batch size: the first dimension of every input is
exported free, and the session is tried on a batch twice the example's against the
model itself. A model whose graph fixes its batch (a reshape to a traced constant) fails
that check; it is exported again, with fixed shapes, for each new input shape it meets.

Its sessions do not spin between runs: the engine times them in alternation with other
runners, which spinning threads would slow (a saved ``.onnx`` loads with ONNX Runtime's
default, and its speed is measured alone, reloaded in a new process).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch

from bladesmith.onnx.sessions import without_spinning
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes.built_for import tensors_in
from bladesmith.runtimes.onnxruntime import SUFFIX as ONNX_SUFFIX
from bladesmith.runtimes.onnxruntime import OnnxRunnerPerShape, cpu_runner, export_for_any_batch
from bladesmith.runtimes.torchscript import SUFFIX as TORCHSCRIPT_SUFFIX


class OnnxRuntime(Pass):
    """ONNX export + ONNX Runtime session (CPU execution provider), any batch size."""

    name = "onnxruntime"
    devices = ("cpu",)
    saves_as = ONNX_SUFFIX
    refuses_formats = {
        TORCHSCRIPT_SUFFIX: "the module runs in ONNX Runtime; as TorchScript it would run "
        f"another way, slower than what was measured: save it as {ONNX_SUFFIX}"
    }

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed (pip install onnxruntime)"
        if candidate.dtype == torch.bfloat16:
            return "ONNX Runtime's CPU kernels take no bfloat16 (a bfloat16 pass was kept)"
        from bladesmith.onnx.exporter import held_constants

        baked = held_constants(candidate.module, candidate.runner_args(context.example_args))
        if baked:
            return (
                f"the test data passes non-tensor arguments ({', '.join(baked)}), which an "
                "ONNX export holds as constants: ONNX Runtime would answer every call as if "
                "for these values"
            )
        sizes = sorted({_sizes_past_the_batch(candidate.runner_args(x)) for x in context.test_args})
        if len(sizes) > 1:
            return (
                "the test data has inputs of more than one size past the batch "
                f"({' and '.join(', '.join(map(str, each)) for each in sizes)}): an ONNX export "
                "fixes every size but the batch"
            )
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
        module, args = candidate.module, candidate.runner_args(context.example_args)
        with (
            without_spinning(),
            tempfile.TemporaryDirectory(prefix="bladesmith-onnx-") as directory,
        ):
            path = Path(directory) / "model.onnx"
            output_spec, none_outputs, runner = export_for_any_batch(
                module, args, path, context.step
            )
            if runner is None:
                fixed = cpu_runner(path, output_spec, none_outputs)
                runner = OnnxRunnerPerShape(module, args, fixed)
                context.notes.append(
                    "onnxruntime: the export does not follow the batch size; each new input "
                    "shape is exported again on its first call"
                )
        return candidate.with_runner(runner, self.name)


def _sizes_past_the_batch(args: tuple) -> tuple:
    """The shapes of the tensors in ``args``, the batch dimension left out."""
    return tuple(tuple(x.shape[1:]) for x in tensors_in(args))
