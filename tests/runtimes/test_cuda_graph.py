"""CudaGraphRunner: a graph per input signature, outputs packed and surviving the next call."""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.runtimes.cuda_graph import CudaGraphRunner, _PackedOutputs
from engine_testing import (
    cuda,
)


@cuda
def test_cuda_graph_runner_replays_per_shape_and_outputs_survive_the_next_call():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).cuda().eval()
    runner = CudaGraphRunner(model, torch.device("cuda"))
    a, b = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    out_a = runner(a)
    out_b = runner(b)
    with torch.no_grad():
        torch.testing.assert_close(out_a, model(a))
        torch.testing.assert_close(out_b, model(b))
    runner(torch.randn(6, 8, device="cuda"))
    assert len(runner.graphs) == 2


def test_packed_outputs_come_back_with_their_dtypes_shapes_and_structure():
    outputs = (
        torch.arange(6, dtype=torch.float16).view(2, 3),
        {"ids": torch.tensor([1, -2], dtype=torch.int64), "name": "kept"},
        torch.tensor([True, False, True]),
        torch.rand(5, 4),
    )
    assert _PackedOutputs.packable(outputs)
    packed = _PackedOutputs(outputs)
    first = packed.copy()
    packed.buffer.zero_()  # as the graph's next replay overwrites it
    second = packed.copy()
    assert first[1]["name"] == "kept"
    for got, want in (
        (first[0], torch.arange(6, dtype=torch.float16).view(2, 3)),
        (first[1]["ids"], torch.tensor([1, -2])),
        (first[2], torch.tensor([True, False, True])),
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert first[3].shape == (5, 4) and first[3].dtype == torch.float32
    assert not second[3].any() and not second[1]["ids"].any()


def test_outputs_are_packed_only_when_small_contiguous_and_several():
    small = torch.zeros(4)
    assert not _PackedOutputs.packable((small,))  # one output: nothing to save
    assert not _PackedOutputs.packable((small, torch.zeros(4, 4).t()))
    assert not _PackedOutputs.packable((small, torch.zeros(1 << 20)))  # 4 MiB: one copy each


@cuda
def test_cuda_graph_runner_returns_packed_outputs_that_survive_the_next_call():
    class TwoOutputs(nn.Module):
        def forward(self, x, scale=1.0):
            return {"sum": x.sum(1) * scale, "top": x.argmax(1)}

    runner = CudaGraphRunner(TwoOutputs(), torch.device("cuda"))
    a, b = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    out_a = runner(a)
    out_b = runner(b)
    assert next(iter(runner.graphs.values())).packed is not None
    torch.testing.assert_close(out_a["sum"], a.sum(1))
    assert torch.equal(out_a["top"], a.argmax(1)) and out_a["top"].dtype == torch.int64
    torch.testing.assert_close(out_b["sum"], b.sum(1))
    # Keyword arguments take the general path, a graph of their own.
    torch.testing.assert_close(runner(a, scale=2.0)["sum"], a.sum(1) * 2)
    assert len(runner.graphs) == 2
    needs_grad = a.clone().requires_grad_()
    torch.testing.assert_close(runner(needs_grad)["sum"], a.sum(1))
    statics = [s for g in runner.graphs.values() for s in g.static_inputs if s is not None]
    assert not any(s.requires_grad for s in statics)
