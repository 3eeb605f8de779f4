"""The openvino pass and the .ov format: torchvision models no part of bladesmith was
written for, optimized, saved, reloaded in a new process with the same outputs; the
settings recorded and applied on load; an operator the converter cannot take refused
by name; a file loaded where openvino is missing refused in one line; Triton export."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest
import torch
import torchvision
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes.openvino import OpenVino, OpenVinoF32
from engine_testing import USER_OPERATOR, Wasteful
from test_reload import reload_in_new_process

pytest.importorskip("openvino")


def optimized_with_openvino(model, x, **settings):
    config = Config(warmup=1, iters=5, save_as=".ov", progress=False, **settings)
    return bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=config, passes=[OpenVino(), OpenVinoF32()]
    )


@pytest.fixture(scope="module")
def mobilenet():
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None).eval()
    x = torch.rand(1, 3, 64, 64)
    return (model, x, *optimized_with_openvino(model, x, openvino_threads=1, openvino_streams=1))


@pytest.mark.parametrize(
    "name, size",
    [pytest.param("resnet18", 64, marks=pytest.mark.slow), ("mobilenet_v3_small", 64)],
    ids=["resnet18", "mobilenet"],
)
def test_a_torchvision_model_runs_in_openvino_and_reloads_in_a_new_process(
    name, size, tmp_path, mobilenet
):
    if name == "mobilenet_v3_small":
        model, x, optimized, spec, report = mobilenet
    else:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None).eval()
        x = torch.rand(1, 3, size, size)
        optimized, spec, report = optimized_with_openvino(model, x)
    records = {record.name: record for record in report.optimizations}
    assert spec.backend == "openvino", records["openvino"].reason
    assert spec.save_formats == (".ov",)
    # Its precision is what OpenVINO compiled in, and the result's dtype says it.
    note = next(line for line in report.diagnosis["notes"] if line.startswith("openvino "))
    precision = note.split("INFERENCE_PRECISION_HINT=")[1].split()[0]
    assert spec.dtype == {"f32": "float32", "bf16": "bfloat16"}[precision]
    # Within the tolerance the result was verified at (bf16's on a CPU with bf16)
    close = {"rtol": 1e-3, "atol": 1e-4}
    if spec.dtype == "bfloat16":
        close = {"rtol": spec.tolerance["rtol"], "atol": spec.tolerance["atol"]}
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), **close)
        expected = optimized(x)
    path = bladesmith.save(optimized, tmp_path / "model.ov")
    assert reload_in_new_process(path, (x,), expected, tmp_path).startswith("cpu ")


def test_settings_are_recorded_applied_on_load_and_reported(mobilenet, tmp_path):
    _, x, optimized, spec, report = mobilenet
    assert any(
        "INFERENCE_NUM_THREADS=1, NUM_STREAMS=1" in line for line in report.diagnosis["notes"]
    )
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "m.ov"))
    loaded(x)
    runner = loaded._run.runs[next(iter(loaded._run.runs))]
    assert runner.settings == {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": 1,
        "NUM_STREAMS": 1,
    }
    assert runner.used()["INFERENCE_NUM_THREADS"] == "1"
    assert loaded.runtime_settings()["NUM_STREAMS"] == "1"  # what `bladesmith bench` prints


class UsesTheOperator(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return torch.ops.userops_test.scale_clip(self.conv(x), 2.0, 1.5)


def test_a_user_operator_is_refused_by_name(user_library):
    x = torch.rand(1, 3, 16, 16)
    optimized, spec, report = bladesmith.optimize(
        UsesTheOperator().eval(),
        device="cpu",
        test_data=[(x,)],
        config=Config(warmup=0, iters=1, progress=False),
        passes=[OpenVino()],
    )
    (record,) = report.optimizations
    assert record.status == "skipped" and USER_OPERATOR in record.reason
    assert USER_OPERATOR in spec.refused_formats[".ov"]


def _scale_clip_in_standard_onnx(g, x, scale, limit):
    def constant(value):
        return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))

    return g.op("Clip", g.op("Mul", x, constant(scale)), constant(-limit), constant(limit))


def test_a_user_operator_with_a_standard_onnx_lowering_converts_through_onnx(
    user_library, monkeypatch
):
    from bladesmith.onnx import user_ops

    monkeypatch.setattr(user_ops, "_TRANSLATIONS", {})
    user_ops.register_op(USER_OPERATOR, symbolic=_scale_clip_in_standard_onnx)
    torch.manual_seed(0)
    model, x = Wasteful(UsesTheOperator()).eval(), torch.randn(1, 3, 16, 16)
    optimized, spec, report = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[(x,)],
        config=Config(warmup=0, iters=1, progress=False, save_as=".ov"),
        passes=[OpenVino()],
    )
    (record,) = report.optimizations
    assert spec.backend == "openvino" and ".ov" not in spec.refused_formats, record.reason
    assert any(f"{USER_OPERATOR} lowered" in line for line in report.diagnosis["notes"])
    with torch.no_grad():
        got, expected = optimized(x), model(x)
    assert expected.abs().max() == 1.5  # the clip is exercised
    # OpenVINO computes in bf16 on a CPU with bf16 instructions, as the spec says
    close = {"rtol": 1e-2, "atol": 2e-2} if spec.dtype == "bfloat16" else {}
    torch.testing.assert_close(got, expected, **{"rtol": 1e-5, "atol": 1e-5, **close})


_WITHOUT_OPENVINO = """
import sys
sys.modules["openvino"] = None  # as if it were not installed: its import fails
from bladesmith.cli import main
sys.exit(main(["bench", sys.argv[1]]))
"""


def test_a_file_loaded_without_openvino_names_the_package_in_one_line(mobilenet, tmp_path):
    _, _, optimized, _, _ = mobilenet
    path = bladesmith.save(optimized, tmp_path / "m.ov")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OPENVINO, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "openvino" in lines[0] and "pip install" in lines[0] and str(path) in lines[0]


def test_export_triton_serves_it_through_the_python_backend(mobilenet, tmp_path):
    from bladesmith.serve.repository import write_repository

    _, _, optimized, _, _ = mobilenet
    path = bladesmith.save(optimized, tmp_path / "m.ov")
    model_dir = write_repository(path, tmp_path / "repo")
    assert 'backend: "python"' in (model_dir / "config.pbtxt").read_text()
    assert (model_dir / "1" / "m.ov").is_file() and (model_dir / "1" / "model.py").is_file()


@pytest.mark.slow
def test_serve_answers_a_request_with_the_artifacts_outputs(mobilenet, tmp_path):
    """`bladesmith serve` of a .ov: tritonserver started, asked, its answer the loaded
    artifact's, stopped (the context manager's exit)."""
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")
    from serve.serve_testing import free_ports  # tests/serve, a namespace package

    _, x, optimized, _, _ = mobilenet
    path = bladesmith.save(optimized, tmp_path / "m.ov")
    http, grpc, metrics = free_ports(3)
    with bladesmith.serve(
        path, http_port=http, grpc_port=grpc, metrics_port=metrics, block=False
    ) as server:
        with bladesmith.client(server.url, "m") as client:
            (answer,) = client(x.numpy())
    with pytest.raises(OSError):  # stopped: nothing answers on its port
        urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/live", timeout=5)
    with torch.no_grad():
        expected = optimized(x)[0]
    torch.testing.assert_close(answer["output_0"], expected, rtol=1e-4, atol=1e-5)


def test_doctor_lists_openvino_and_its_devices():
    from bladesmith.environment import _shown_packages, installed_packages

    (shown,) = [p for p in _shown_packages(installed_packages(), {}) if p.name == "openvino"]
    assert shown.version is not None and shown.detail.startswith("devices: CPU (")


def test_a_detector_pipeline_runs_in_openvino_with_its_nms_as_the_cpu_kernel_gives_it():
    """The fixed-shape pipeline calls bladesmith's decode + NMS, which OpenVINO's PyTorch
    converter has no rule for: it converts through ONNX, NMS as NonMaxSuppression, and
    gives the CPU kernel's detections, slot for slot."""
    from bladesmith.passes import Candidate
    from bladesmith.passes.fixed_shape import FixedShape
    from engine_testing import context_for, tiny_detector

    model, photos = tiny_detector()
    context = context_for((photos,))
    pipeline = FixedShape().apply(Candidate(module=model, device=torch.device("cpu")), context)
    assert OpenVino().skip_reason(pipeline, context) is None
    converted = OpenVino().apply(pipeline, context)
    assert any("bladesmith::retinanet_postprocess lowered" in n for n in context.notes)
    args = pipeline.runner_args(context.example_args)
    with torch.no_grad():
        boxes, scores, labels, count = pipeline.module(*args)
        got_boxes, got_scores, got_labels, got_count = converted.module(*args)
    assert int(count) > 100 and torch.equal(got_count, count)  # the NMS kept as many
    assert torch.equal(got_labels, labels)
    torch.testing.assert_close(got_scores, scores, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_boxes, boxes, rtol=1e-4, atol=1e-2)


def test_a_detector_pipeline_quantizes_to_int8_with_its_nms_converted_as_in_float():
    """openvino_int8 converts the pipeline as the openvino pass does (through ONNX), so
    its NMS runs as NonMaxSuppression and the pipeline's outputs keep their shapes."""
    pytest.importorskip("nncf")
    from bladesmith.passes import Candidate
    from bladesmith.passes.fixed_shape import FixedShape
    from bladesmith.passes.openvino_int8 import OpenVinoInt8
    from engine_testing import context_for, tiny_detector

    model, photos = tiny_detector()
    context = context_for((photos,))
    context.calibration = lambda: ([(photos,)], "the test photographs")
    pipeline = FixedShape().apply(Candidate(module=model, device=torch.device("cpu")), context)
    assert OpenVinoInt8().skip_reason(pipeline, context) is None
    quantized = OpenVinoInt8().apply(pipeline, context)
    assert quantized.backend == "openvino_int8" and quantized.computes_in.name == "int8"
    args = pipeline.runner_args(context.example_args)
    with torch.no_grad():
        expected, got = pipeline.module(*args), quantized(*args)
    assert [each.shape for each in got] == [each.shape for each in expected]
    assert int(got[3].min()) > 0  # detections kept in every image


@pytest.mark.slow
def test_a_detector_saved_as_ov_reloads_in_a_new_process_with_its_detections(tmp_path):
    from bladesmith.passes.fixed_shape import FixedShape
    from engine_testing import tiny_detector

    model, photos = tiny_detector()
    optimized, spec, report = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[(photos,)],
        config=Config(warmup=0, iters=1, progress=False, save_as=".ov"),
        passes=[FixedShape(), OpenVino()],
    )
    records = {record.name: record for record in report.optimizations}
    assert spec.backend == "openvino", records["openvino"].reason
    with torch.no_grad():
        expected = optimized(photos)
    path = bladesmith.save(optimized, tmp_path / "detector.ov")
    assert reload_in_new_process(path, (photos,), expected, tmp_path).startswith("cpu ")


class BatchedNms(nn.Module):
    def forward(self, boxes, scores, labels):
        return torch.ops.bladesmith.batched_nms(boxes, scores, labels, 0.5, 40)


def test_bladesmith_batched_nms_in_openvino_keeps_what_the_cpu_kernel_keeps():
    """A lone batched_nms (labels as data) converts through ONNX (NonMaxSuppression on
    boxes offset by class) and keeps the CPU kernel's detections in its order, padding
    and ignored entries (negative labels) included, on many overlapping boxes."""
    from bladesmith import ops
    from bladesmith.passes import Candidate
    from engine_testing import context_for

    ops.load_library()
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(2, 200, 2, generator=generator) * 100
    sides = torch.rand(2, 200, 2, generator=generator) * 30 + 5
    boxes = torch.cat([corners, corners + sides], dim=2)
    scores = torch.rand(2, 200, generator=generator)
    labels = torch.randint(-1, 4, (2, 200), generator=generator)
    args = (boxes, scores, labels)
    context = context_for(args)
    candidate = Candidate(module=BatchedNms(), device=torch.device("cpu"))
    assert OpenVino().skip_reason(candidate, context) is None
    converted = OpenVino().apply(candidate, context)
    expected, got = BatchedNms()(*args), converted.module(*args)
    assert 0 < int(expected[3].min()) and int(expected[3].max()) <= 40
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
