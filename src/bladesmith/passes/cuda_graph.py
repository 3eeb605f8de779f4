"""cuda_graph: capture the whole call in a CUDA graph and replay it, one launch instead
of hundreds (``runtimes.cuda_graph.CudaGraphRunner``)."""

from __future__ import annotations

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass
from bladesmith.runtimes.cuda_graph import CudaGraphRunner


class CudaGraph(Pass):
    """Whole call captured in a CUDA graph (static input buffers, one graph per shape)."""

    name = "cuda_graph"
    devices = ("cuda",)
    finisher = True
    changes_arithmetic = False  # the captured kernels, replayed

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        runner = CudaGraphRunner(candidate, context.device)
        with context.step("capturing a CUDA graph"):
            runner(*candidate.runner_args(context.example_args))
        return candidate.with_runner(runner, self.name, wraps=True)
