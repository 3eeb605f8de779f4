"""torchscript (and onnxruntime): runners with the module's outputs."""

from __future__ import annotations

import torch

from bladesmith.passes import Candidate
from bladesmith.passes.onnxruntime import OnnxRuntime
from bladesmith.passes.torchscript import TorchScriptFreeze
from engine_testing import (
    context_for,
    conv_net,
)


def test_torchscript_and_onnxruntime_build_runners_with_the_same_outputs():
    model = conv_net()
    x = torch.randn(2, 3, 16, 16)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    context = context_for((x,))
    scripted = TorchScriptFreeze().apply(candidate, context)
    assert scripted.backend == "torchscript" and scripted.module is model
    torch.testing.assert_close(scripted(x), model(x), rtol=1e-4, atol=1e-5)
    session = OnnxRuntime().apply(scripted, context)
    assert session.applied == ("onnxruntime",)  # replaces the TorchScript runner
    torch.testing.assert_close(session(x), model(x), rtol=1e-4, atol=1e-5)
