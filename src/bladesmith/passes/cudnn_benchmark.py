"""cudnn_benchmark: cuDNN times its convolution algorithms for each input shape on the
first call and keeps the fastest, instead of picking one by heuristics.

The setting is process-wide in PyTorch; the runner turns it on around its own calls
only, so the user's setting holds elsewhere. A CUDA graph's capture turns it on during
its warm-up anyway (``cuda_graph``): this pass pays where no graph is kept (a model
that synchronises with the host) or as the first step of a TorchScript model's route.
"""

from __future__ import annotations

import torch

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class CudnnBenchmarkRunner:
    """``fn`` called with cuDNN's benchmark mode on."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        with torch.backends.cudnn.flags(enabled=True, benchmark=True):
            return self.fn(*args, **kwargs)


class CudnnBenchmark(Pass):
    """cuDNN autotuning (benchmark mode) around the model's calls (GPU)."""

    name = "cudnn_benchmark"
    devices = ("cuda",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if not any(p.dim() == 4 for p in candidate.module.parameters()):
            return "the model has no 2-D convolutions (no 4-D weights)"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        runner = CudnnBenchmarkRunner(candidate)
        with context.step("autotuning cuDNN's convolutions"), torch.no_grad():
            runner(*candidate.runner_args(context.example_args))
        return candidate.with_runner(runner, self.name, wraps=True)
