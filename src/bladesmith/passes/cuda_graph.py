"""cuda_graph: capture the whole call in a CUDA graph and replay it, one launch instead
of hundreds; a graph per input shape, with static input buffers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, register

# Runs before capture, on a side stream: lazy initialisation (cuDNN/cuBLAS handles,
# autotuning, allocator growth) must not happen while capturing.
_WARMUP_CALLS = 3


@contextmanager
def _cudnn_benchmark():
    """cuDNN times its convolution algorithms during warm-up; the graph keeps the
    fastest for good. The user's setting is restored after capture."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


class _Graph:
    def __init__(self, graph, static_inputs, static_outputs):
        self.graph = graph
        self.static_inputs = static_inputs
        self.static_outputs = static_outputs


class CudaGraphRunner:
    """``fn`` replayed from CUDA graphs, one captured per input signature (the shapes,
    dtypes and devices of the tensors, and the values of everything else).

    Each call copies its tensors into the graph's static input buffers, replays, and
    returns clones of the static outputs, so results stay valid after the next call.
    ``fn`` must do no host synchronisation and keep no state between calls.
    """

    def __init__(self, fn: Callable, device: torch.device):
        self.fn = fn
        self.device = device
        self.graphs: dict = {}

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        # str(spec): TreeSpec is hashable only in newer torch releases.
        key = (str(spec), tuple(_signature(leaf) for leaf in leaves))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(leaves, spec)
        for static, leaf in zip(entry.static_inputs, leaves):
            if static is not None:
                static.copy_(leaf)
        entry.graph.replay()
        return pytree.tree_map(_clone, entry.static_outputs)

    def _capture(self, leaves, spec) -> _Graph:
        static_inputs = [
            leaf.detach().clone() if isinstance(leaf, torch.Tensor) else None for leaf in leaves
        ]
        call_leaves = [s if s is not None else leaf for s, leaf in zip(static_inputs, leaves)]
        args, kwargs = pytree.tree_unflatten(call_leaves, spec)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with _cudnn_benchmark():
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_CALLS):
                    self.fn(*args, **kwargs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_outputs = self.fn(*args, **kwargs)
        return _Graph(graph, static_inputs, static_outputs)


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _signature(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    return ("value", type(leaf).__name__, repr(leaf))


@register
class CudaGraph(Pass):
    """Whole call captured in a CUDA graph (static input buffers, one graph per shape)."""

    name = "cuda_graph"
    devices = ("cuda",)
    finisher = True

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        runner = CudaGraphRunner(candidate, context.device)
        with context.step("capturing a CUDA graph"):
            runner(*candidate.runner_args(context.example_args))
        return candidate.with_runner(runner, self.name, wraps=True)
