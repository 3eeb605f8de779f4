"""torch.compile with Inductor: fused kernels for the whole model, shapes fixed.

Inductor's own CUDA graphs are off (mode "default" or "max-autotune-no-cudagraphs"):
the cuda_graph pass captures the whole call instead, input copies included, so one
graph replays everything from image to boxes. Freezing is on: the weights become
constants, so Inductor folds (frozen) batch norms into convolutions and picks the
weights' layout once. The result saves as a ``.ptc`` (``runtimes.compiled_program``):
its programs and the code Inductor compiled for them.
"""

from __future__ import annotations

import torch

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes import compiled_program
from bladesmith.runtimes.torchscript import is_torchscript

# Inductor's C++ build of a whole detector takes minutes on a small CPU; worth it only
# when asked for a longer build.
_CPU_LEVELS = ("o2",)


def compile_mode(level: str) -> str:
    """o2 autotunes kernels (GEMM/convolution templates; minutes of build), o0/o1 not."""
    return "max-autotune-no-cudagraphs" if level == "o2" else "default"


class Inductor(Pass):
    """torch.compile (Inductor), static shapes, frozen weights; max-autotune at o2."""

    name = "inductor"
    saves_as = compiled_program.SUFFIX

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if is_torchscript(candidate.module):
            return "torch.compile cannot trace TorchScript (the torchscript pass is its route)"
        if context.device.type == "cpu" and context.level not in _CPU_LEVELS:
            return "Inductor's C++ build takes minutes on a CPU; it runs at level o2"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        from bladesmith.ops.libraries import without_fake_kernel

        opaque = without_fake_kernel(context.user_operators)
        if opaque:  # Dynamo breaks the graph there and calls the operator as it is
            context.notes.append(
                f"inductor: {', '.join(opaque)} has no fake kernel; it runs as an opaque call "
                "between compiled graphs (torch.library.register_fake lets Inductor see through)"
            )
        return compiled(candidate, context)


def compiled(candidate: Candidate, context: Context) -> Candidate:
    """``candidate`` with its module compiled by Inductor (the mode ``context.level``
    asks for, frozen weights, compiled on the example) as its runner."""
    mode = compile_mode(context.level)
    runner = torch.compile(candidate.module, mode=mode, dynamic=False)
    # What a .ptc of the result compiles with. Torch's caches skip frozen graphs, so a
    # frozen .ptc carries no compiled code and compiles at load: on a GPU it is saved
    # unfrozen (ResNet-50 ran 0.319 ms unfrozen, 0.315 frozen); on a CPU frozen, as
    # timed here (unfrozen, its convolutions lose oneDNN's packed weights: 0.57x).
    setattr(
        runner,
        compiled_program.SETTINGS_ATTRIBUTE,
        {"max_autotune": mode != compile_mode("o0"), "freezing": context.device.type == "cpu"},
    )
    # Inductor reads its config when it compiles, on the first call.
    with (
        context.step(f"compiling with Inductor (mode={mode})"),
        torch._inductor.config.patch(freezing=True),
        torch.no_grad(),
    ):
        runner(*candidate.runner_args(context.example_args))
    return candidate.with_runner(runner, Inductor.name)
