"""The saved formats' refusals say what went wrong, in one line."""

from __future__ import annotations

import dataclasses

import torch

import bladesmith
from bladesmith.engine import result, saved_formats
from bladesmith.passes import openvino as openvino_pass
from bladesmith.passes.torchscript import TorchScriptFreeze
from bladesmith.spec import Spec


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


def test_a_runtime_computing_in_a_dtype_refuses_formats_only_where_it_was_kept(monkeypatch):
    """On a CPU with bf16 instructions OpenVINO computes in bf16; its refusals (every
    format but .ov: the model runs in OpenVINO) belong to its runner, so a bf16 result of
    the bf16 pass is refused .onnx for bf16's reason alone, and .pt not at all."""
    monkeypatch.setattr(openvino_pass, "_installed_default", lambda: "bf16")
    spec = Spec("cpu", "bfloat16", ((1, 3),), "as the model", ("bf16",), "eager", ())
    refused = result._dtype_refusals(spec)
    assert set(refused) == {".onnx"}, refused
    assert "ONNX Runtime" in refused[".onnx"] and "bf16" in refused[".onnx"]
    kept = dataclasses.replace(spec, passes=("openvino",), backend="openvino")
    assert ".pt" in result._dtype_refusals(kept)


def test_a_float8_result_is_refused_the_formats_that_cannot_hold_it_before_trying_them():
    spec = Spec("cuda", "float8", ((4, 64),), "as the model", ("fp8", "inductor"), "inductor", ())
    refused = result._dtype_refusals(spec)
    assert set(refused) == {".pt", ".onnx"}, refused
    assert refused[".pt"].startswith("float8 was kept (fp8), and a TorchScript file")
    assert refused[".onnx"].endswith("save it as .ptc")
