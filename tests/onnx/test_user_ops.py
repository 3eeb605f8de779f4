"""The user's operators in ONNX, with an operator registered from Python (no library to
build): standard mode lowers them or refuses, and a file holding them as custom nodes is
said to need bladesmith.onnx.session, by check and by export triton."""

from __future__ import annotations

import onnx
import onnxscript
import pytest
import torch
from onnxscript import opset17 as op
from torch import nn

from bladesmith.errors import BladesmithError
from bladesmith.onnx import user_ops
from bladesmith.onnx.checker import check
from bladesmith.onnx.exporter import export
from bladesmith.serve.repository import write_repository

OPERATOR = "onnx_user_test::twice"


@torch.library.custom_op(OPERATOR, mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


@onnxscript.script(onnxscript.values.Opset("onnx_user_test", 1))
def Twice(x):
    return op.Add(x, x)


class CallsIt(nn.Module):
    def forward(self, x):
        return torch.relu(torch.ops.onnx_user_test.twice(x))


@pytest.fixture
def translations(monkeypatch):
    """The registrations of one test only."""
    monkeypatch.setattr(user_ops, "_TRANSLATIONS", {})


@pytest.mark.parametrize("form", ["eager", "scripted"])
def test_standard_mode_refuses_a_custom_node_and_lowers_an_onnxscript(translations, tmp_path, form):
    model = CallsIt() if form == "eager" else torch.jit.script(CallsIt())
    x = torch.rand(2, 3)
    user_ops.register_op(OPERATOR)
    with pytest.raises(BladesmithError) as raised:
        export(model, (x,), tmp_path / "custom.onnx", custom_ops="standard")
    assert str(raised.value) == user_ops.not_standard_message(OPERATOR)
    assert f'register_op("{OPERATOR}", onnxscript=...)' in str(raised.value)
    assert not list(tmp_path.iterdir())  # nothing written

    user_ops.register_op(OPERATOR, onnxscript=Twice)
    path = export(model, (x,), tmp_path / "lowered.onnx", custom_ops="standard")
    lowered = onnx.load(str(path))
    assert {node.domain for node in lowered.graph.node} <= {"", "onnx_user_test"}
    assert not [f for f in check(lowered, "ort-cpu") if f.severity == "error"]


def test_check_says_a_custom_node_of_the_users_needs_bladesmiths_session(translations, tmp_path):
    user_ops.register_op(OPERATOR)
    path = export(CallsIt(), (torch.rand(2, 3),), tmp_path / "custom.onnx")
    findings = check(onnx.load(str(path)), ["ort-cpu", "tensorrt"])
    (ort,) = [f for f in findings if f.target == "ort-cpu"]
    assert ort.severity == "error" and "onnxruntime_extensions" not in ort.hint
    assert ort.message == (
        "ai.onnx.contrib::onnx_user_test_twice runs the PyTorch kernel of "
        f"{OPERATOR}, which ONNX Runtime CPU has only inside bladesmith.onnx.session with "
        "the operator's library loaded"
    )
    assert f'register_op("{OPERATOR}", onnxscript=...)' in ort.hint
    (trt,) = [f for f in findings if f.target == "tensorrt"]
    assert trt.severity == "warning" and "plugin" in trt.hint

    # Triton's onnxruntime backend: --custom-ops standard alone would be refused.
    with pytest.raises(BladesmithError) as raised:
        write_repository(path, tmp_path / "repo", backend="onnxruntime")
    assert f"export standard ONNX with a lowering of {OPERATOR}" in str(raised.value)
    assert "--custom-ops standard)" not in str(raised.value)
