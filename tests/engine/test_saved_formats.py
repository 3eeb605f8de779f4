"""The saved formats' refusals say what went wrong, in one line."""

from __future__ import annotations

import torch

import bladesmith
from bladesmith.engine import saved_formats
from bladesmith.passes.torchscript import TorchScriptFreeze


def test_a_save_that_fails_names_the_cause_even_when_torch_starts_on_a_new_line(monkeypatch):
    # TorchScript's compiler starts its messages on a new line: the reason kept only the
    # first line, "saving it and loading it back failed (RuntimeError: )".
    def write(optimized, path):
        raise RuntimeError(
            "\nUnknown builtin op: torchvision::nms.\nCould not find any similar ops"
        )

    monkeypatch.setattr(saved_formats, "write", write)
    model = torch.nn.Linear(3, 2).eval()
    _, spec, _ = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[torch.rand(1, 3)],
        config=bladesmith.Config(warmup=0, iters=2, progress=False),
        passes=[TorchScriptFreeze()],
    )
    assert spec.refused_formats[".pt"] == (
        "saving it and loading it back failed (RuntimeError: Unknown builtin op: "
        "torchvision::nms. Could not find any similar ops)"
    ), spec.refused_formats
