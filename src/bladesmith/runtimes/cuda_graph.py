"""CudaGraphRunner: a call captured in a CUDA graph and replayed, one launch instead of
hundreds; a graph per input signature, with static input buffers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree

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


# Outputs up to this size are packed into one buffer inside the graph, so that a call
# returns them with one copy kernel instead of one per output: for small outputs (a
# detector's padded detections) the launches cost more than the bytes.
_PACK_LIMIT_BYTES = 1 << 20


class _PackedOutputs:
    """The graph's tensor outputs, concatenated as bytes into one buffer by the graph.

    Tensors are packed in order of decreasing element size, so that each one's offset is
    a multiple of its element size and the copy can be viewed back with its dtype.
    """

    def __init__(self, outputs):
        leaves, self.spec = pytree.tree_flatten(outputs)
        self.leaves = leaves
        tensors = sorted(
            (i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)),
            key=lambda i: -leaves[i].element_size(),
        )
        self.slots = []  # (leaf index, first byte, last byte + 1, dtype, shape)
        offset = 0
        for i in tensors:
            tensor = leaves[i]
            end = offset + tensor.numel() * tensor.element_size()
            self.slots.append((i, offset, end, tensor.dtype, tensor.shape))
            offset = end
        self.buffer = torch.cat([leaves[i].reshape(-1).view(torch.uint8) for i in tensors])

    @staticmethod
    def packable(outputs) -> bool:
        tensors = [leaf for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
        return (
            len(tensors) > 1
            and len({t.device for t in tensors}) == 1
            and all(t.is_contiguous() for t in tensors)
            and sum(t.numel() * t.element_size() for t in tensors) <= _PACK_LIMIT_BYTES
        )

    def copy(self):
        """The outputs, in one new buffer of their own."""
        buffer = self.buffer.clone()
        leaves = list(self.leaves)
        for i, start, end, dtype, shape in self.slots:
            leaves[i] = buffer[start:end].view(dtype).view(shape)
        return pytree.tree_unflatten(leaves, self.spec)


class _Graph:
    def __init__(self, graph, static_inputs, static_outputs, packed):
        self.graph = graph
        self.static_inputs = static_inputs
        self.static_outputs = static_outputs
        self.packed = packed  # _PackedOutputs, or None: outputs are cloned one by one

    def outputs(self):
        if self.packed is not None:
            return self.packed.copy()
        return pytree.tree_map(_clone, self.static_outputs)


class CudaGraphRunner:
    """``fn`` replayed from CUDA graphs, one captured per input signature (the shapes,
    dtypes and devices of the tensors, and the values of everything else).

    Each call copies its tensors into the graph's static input buffers, replays, and
    returns copies of the static outputs, so results stay valid after the next call.
    ``fn`` must do no host synchronisation and keep no state between calls.
    """

    def __init__(self, fn: Callable, device: torch.device):
        self.fn = fn
        self.device = device
        self.graphs: dict = {}

    def __call__(self, *args, **kwargs):
        # Every microsecond here delays the graph's start: one tensor, the usual call,
        # skips the flattening of the arguments.
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            leaves, key = args, (_ONE_TENSOR, _signature(args[0]))
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            # str(spec): TreeSpec is hashable only in newer torch releases.
            key = (str(spec), tuple(_signature(leaf) for leaf in leaves))
        entry = self.graphs.get(key)
        if entry is None:
            with torch.no_grad():
                entry = self.graphs[key] = self._capture(args, kwargs)
        for static, leaf in zip(entry.static_inputs, leaves):
            if static is not None:
                static.copy_(leaf.detach() if leaf.requires_grad else leaf)
        entry.graph.replay()
        return entry.outputs()

    def _capture(self, args, kwargs) -> _Graph:
        leaves, spec = pytree.tree_flatten((args, kwargs))
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
                packed = (
                    _PackedOutputs(static_outputs)
                    if _PackedOutputs.packable(static_outputs)
                    else None
                )
        return _Graph(graph, static_inputs, static_outputs, packed)


_ONE_TENSOR = "one tensor"


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _signature(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    return ("value", type(leaf).__name__, repr(leaf))
