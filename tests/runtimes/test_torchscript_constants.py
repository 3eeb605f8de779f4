"""A traced model's shape arithmetic stays on the host when it is loaded onto a device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bladesmith.runtimes.torchscript import (
    freeze,
    host_read_constants,
    host_scalar_constants,
    quiet_torchscript,
)
from engine_testing import cuda


class Halves(nn.Module):
    """Shape arithmetic in a forward, as a detector's head concatenation does it."""

    def forward(self, x):
        first = (x.shape[1] + 1) // 2
        return x[:, :first] * 2, x[:, first:]


def traced_and_loaded(tmp_path, map_location, model=None):
    x = torch.rand(2, 5)
    with quiet_torchscript():
        traced = torch.jit.trace(model or Halves(), (x,), check_trace=False)
        torch.jit.save(traced, str(tmp_path / "model.pt"))
        return torch.jit.load(str(tmp_path / "model.pt"), map_location=map_location)


def constants_moved_to_meta(module):
    """What ``map_location="cuda"`` does to a model's constants, on a machine with no GPU
    (loading with ``map_location="meta"`` itself fails)."""
    graph = module.graph
    for node in graph.findAllNodes("prim::Constant"):
        if node.hasAttribute("value") and node.kindOf("value") == "t":
            with graph.insert_point_guard(node):
                moved = graph.insertConstant(node.t("value").to("meta"))
            node.output().replaceAllUsesWith(moved)
            node.destroy()
    return module


def scalar_constant_devices(module) -> list[str]:
    graph = module.graph if isinstance(module, torch.jit.ScriptModule) else module
    return sorted(
        node.t("value").device.type
        for node in graph.findAllNodes("prim::Constant")
        if node.hasAttribute("value") and node.kindOf("value") == "t"
    )


def test_constants_off_the_host_that_the_host_reads_are_found(tmp_path):
    x = torch.rand(3, 7)
    loaded = traced_and_loaded(tmp_path, "cpu")
    broken = constants_moved_to_meta(torch.jit.freeze(loaded.eval()))
    assert scalar_constant_devices(broken) == ["meta", "meta"]
    with pytest.raises(RuntimeError):
        broken(x)  # int() of a value off the host
    found = host_read_constants(broken.graph)
    users = sorted(use.user.kind() for node in found for use in node.output().uses())
    # the + 1, and the 2 of // 2 (which freezing pooled with the * 2: a CPU scalar
    # multiplies a GPU tensor as well)
    assert users == ["aten::add", "aten::floor_divide", "aten::mul"]


def test_constants_on_the_host_or_not_read_there_are_left_alone(tmp_path):
    frozen = torch.jit.freeze(traced_and_loaded(tmp_path, "cpu").eval())
    assert host_scalar_constants(frozen.graph) == 0

    class Offset(nn.Module):  # a device constant that only device arithmetic uses
        def forward(self, x):
            return x + torch.tensor(3)

    loaded = constants_moved_to_meta(traced_and_loaded(tmp_path, "cpu", Offset()))
    assert scalar_constant_devices(loaded.graph) == ["meta"]
    assert host_scalar_constants(loaded.graph) == 0


@cuda
def test_a_traced_model_loaded_onto_the_gpu_can_be_captured_once_frozen(tmp_path):
    from bladesmith.runtimes.cuda_graph import CudaGraphRunner

    loaded = traced_and_loaded(tmp_path, "cuda")
    x = torch.rand(3, 7, device="cuda")
    runner = CudaGraphRunner(freeze(loaded, (x,)), torch.device("cuda"))
    first, second = runner(x)
    torch.testing.assert_close(first, x[:, :4] * 2)
    torch.testing.assert_close(second, x[:, 4:])
