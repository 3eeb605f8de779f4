"""A new process imports torchvision (1.2 s of a 1.6 s load on a 2-core CPU) to load an
artifact that calls torchvision's operators, and only then."""

from __future__ import annotations

import subprocess
import sys

import torch
import torchvision
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes.torchscript import TorchScriptFreeze

QUICK = Config(warmup=0, iters=1, min_speedup=1e-6, progress=False)

# Load the artifact in a new interpreter, run it, say whether torchvision got imported.
_LOAD = """
import sys, torch, bladesmith
module = bladesmith.load(sys.argv[1], trust=True)
args = torch.load(sys.argv[2], weights_only=True)
expected = torch.load(sys.argv[3], weights_only=True)
torch.testing.assert_close(module(*args), expected)
print("torchvision" in sys.modules)
"""


class Suppressed(nn.Module):
    def forward(self, boxes, scores):
        return torchvision.ops.nms(boxes, scores * 2, 0.5)


def imports_torchvision(tmp_path, model, args: tuple) -> bool:
    optimized, spec, _ = bladesmith.optimize(
        model.eval(), device="cpu", test_data=[args], config=QUICK, passes=[TorchScriptFreeze()]
    )
    assert spec.passes == ("torchscript",)
    path = bladesmith.save(optimized, tmp_path / "model.pt")
    torch.save(args, tmp_path / "args.pt")
    torch.save(optimized(*args), tmp_path / "expected.pt")
    files = [str(path), str(tmp_path / "args.pt"), str(tmp_path / "expected.pt")]
    result = subprocess.run(
        [sys.executable, "-c", _LOAD, *files], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[-1] == "True"


def test_an_artifact_calling_torchvisions_nms_loads_it_in_a_new_process(tmp_path):
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]])
    assert imports_torchvision(tmp_path, Suppressed(), (boxes, torch.tensor([0.9, 0.8, 0.7])))


def test_an_artifact_calling_none_of_torchvisions_operators_loads_without_it(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    assert not imports_torchvision(tmp_path, model, (torch.randn(2, 4),))
