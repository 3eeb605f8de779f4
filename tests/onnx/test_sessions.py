"""bladesmith.onnx.sessions: provider plans (no hardware needed) and sessions on the CPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from bladesmith.errors import BladesmithError, DeviceUnavailableError
from bladesmith.onnx.sessions import (
    CPU,
    CUDA,
    DIRECTML,
    TENSORRT,
    Session,
    plan_providers,
    session,
)

GPU_BUILD = [TENSORRT, CUDA, CPU]
DML_BUILD = [DIRECTML, CPU]


def test_cpu_plan_is_cpu_only_whatever_is_available():
    plan = plan_providers("cpu", GPU_BUILD)
    assert plan.providers == [(CPU, {})]
    assert plan.session_settings == {}


def test_auto_prefers_cuda_then_directml_then_cpu_and_never_tensorrt():
    assert plan_providers("auto", GPU_BUILD).names == [CUDA, CPU]
    assert plan_providers("auto", DML_BUILD).names == [DIRECTML, CPU]
    assert plan_providers("auto", [CPU]).names == [CPU]
    assert plan_providers("auto", [TENSORRT, CPU]).names == [CPU]


def test_cuda_plan_carries_the_device_id():
    plan = plan_providers("cuda:1", GPU_BUILD)
    assert plan.providers == [(CUDA, {"device_id": 1}), (CPU, {})]


def test_directml_plan_turns_memory_patterns_off_and_runs_sequentially():
    plan = plan_providers("dml", DML_BUILD)
    assert plan.providers == [(DIRECTML, {"device_id": 0}), (CPU, {})]
    assert plan.session_settings == {
        "enable_mem_pattern": False,
        "execution_mode": "ORT_SEQUENTIAL",
    }


def test_tensorrt_plan_falls_back_to_cuda_then_cpu_with_its_options(tmp_path):
    plan = plan_providers("tensorrt:2", GPU_BUILD, fp16=True, trt_cache_dir=tmp_path)
    assert plan.names == [TENSORRT, CUDA, CPU]
    name, options = plan.providers[0]
    assert options == {
        "device_id": 2,
        "trt_fp16_enable": True,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(tmp_path),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(tmp_path),
    }
    assert plan.providers[1] == (CUDA, {"device_id": 2})


def test_tensorrt_without_cuda_falls_back_to_cpu_and_caches_under_bladesmith_cache(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("BLADESMITH_CACHE", str(tmp_path))
    plan = plan_providers("tensorrt", [TENSORRT, CPU])
    assert plan.names == [TENSORRT, CPU]
    assert plan.providers[0][1]["trt_engine_cache_path"] == str(tmp_path / "tensorrt")
    assert plan.providers[0][1]["trt_fp16_enable"] is False


@pytest.mark.parametrize(
    ("device", "available", "provider", "advice"),
    [
        ("cuda", [CPU], CUDA, "onnxruntime-gpu"),
        ("tensorrt", [CUDA, CPU], TENSORRT, "tensorrt"),
        ("dml", [CPU], DIRECTML, "onnxruntime-directml"),
    ],
)
def test_a_missing_provider_is_named_with_what_to_install(device, available, provider, advice):
    with pytest.raises(DeviceUnavailableError, match=provider) as caught:
        plan_providers(device, available)
    assert advice in str(caught.value)
    assert "device='cpu'" in str(caught.value)


@pytest.mark.parametrize("device", ["gpu", "cpu:1", "cuda:x", "", "auto:0"])
def test_unknown_device_names_are_rejected_with_the_accepted_ones(device):
    with pytest.raises(BladesmithError, match="tensorrt\\[:N\\]"):
        plan_providers(device, [CPU])


def _affine_model(path):
    node = helper.make_node("Add", ["x", "bias"], ["y"])
    graph = helper.make_graph(
        [node],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("bias", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_session_runs_numpy_and_torch_inputs_and_reports_its_providers(tmp_path):
    ort_session = session(_affine_model(tmp_path / "affine.onnx"), device="cpu", threads=1)
    assert isinstance(ort_session, Session)
    assert ort_session.providers == [CPU]
    assert ort_session.input_names == ["x"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = ort_session.run(x)
    np.testing.assert_array_equal(y, x + [1.0, 2.0, 3.0])
    (y_torch,) = ort_session(torch.from_numpy(x))
    assert isinstance(y_torch, torch.Tensor)
    torch.testing.assert_close(y_torch, torch.from_numpy(y))
    (y_named,) = ort_session.run(x=x)
    np.testing.assert_array_equal(y_named, y)


def test_session_input_errors_name_the_inputs(tmp_path):
    ort_session = session(_affine_model(tmp_path / "affine.onnx"), device="cpu")
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(BladesmithError, match="missing inputs: x"):
        ort_session.run()
    with pytest.raises(BladesmithError, match="inputs are x"):
        ort_session.run(image=x)
    with pytest.raises(BladesmithError, match="takes 1 inputs"):
        ort_session.run(x, x)


def test_session_takes_onnxruntimes_own_run_call(tmp_path):
    import onnxruntime as ort

    ort_session = session(_affine_model(tmp_path / "affine.onnx"), device="cpu")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = ort_session.run(None, {"x": x})
    np.testing.assert_array_equal(y, x + [1.0, 2.0, 3.0])
    (y_named,) = ort_session.run(["y"], {"x": torch.from_numpy(x)}, ort.RunOptions())
    np.testing.assert_array_equal(y_named, y)
    (y_torch,) = ort_session(None, {"x": x})
    torch.testing.assert_close(y_torch, torch.from_numpy(y))
    with pytest.raises(BladesmithError, match="outputs are y"):
        ort_session.run(["z"], {"x": x})
    with pytest.raises(BladesmithError, match="inputs are x"):
        ort_session.run(None, {"images": x})


@pytest.mark.parametrize("arguments", [(None, np.zeros((2, 3), np.float32)), ({"x": 1},)])
def test_a_garbled_run_call_is_told_both_conventions(arguments, tmp_path):
    ort_session = session(_affine_model(tmp_path / "affine.onnx"), device="cpu")
    with pytest.raises(BladesmithError, match="as argument 1") as raised:
        ort_session.run(*arguments)
    assert "by name (run(x), run(name=x))" in str(raised.value)
    assert "run(output_names, {name: array}) (run(None, {'x': x}))" in str(raised.value)


def test_session_refuses_another_shape_or_dtype_in_one_line_saying_what_it_was_exported_for(
    tmp_path,
):
    ort_session = session(_affine_model(tmp_path / "affine.onnx"), device="cpu")
    with pytest.raises(BladesmithError, match=r"input x: got shape \(4, 3\) float32") as raised:
        ort_session.run(np.zeros((4, 3), np.float32))
    assert "exported for (2, 3) float32" in str(raised.value)
    assert "export it again" in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(BladesmithError, match=r"got shape \(2, 3\) float64.*\(2, 3\) float32"):
        ort_session.run(np.zeros((2, 3), np.float64))
    with pytest.raises(BladesmithError, match=r"got shape \(6,\)"):
        ort_session.run(np.zeros(6, np.float32))


def test_session_applies_the_plans_settings_and_reports_the_providers_kept(tmp_path, monkeypatch):
    import onnxruntime as ort

    # This onnxruntime has no DirectML: ONNX Runtime keeps the CPU alone, and says so.
    monkeypatch.setattr(ort, "get_available_providers", lambda: [DIRECTML, CPU])
    ort_session = session(_affine_model(tmp_path / "affine.onnx"), device="dml")
    assert ort_session.plan.names == [DIRECTML, CPU]
    assert ort_session.providers == [CPU]
    options = ort_session.inference_session.get_session_options()
    assert options.enable_mem_pattern is False
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL


def test_session_on_a_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(BladesmithError, match="export one with bladesmith.onnx.export"):
        session(tmp_path / "missing.onnx")
