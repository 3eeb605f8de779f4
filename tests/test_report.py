import io
import json
import os
import stat
import types

import numpy as np
import pytest
import torch
from rich.console import Console

from bladesmith.bench import Timing
from bladesmith.report import (
    PassRecord,
    Report,
    hardware_context,
    software_context,
)
from bladesmith.verify import compare_outputs

PAI_BLADE_KEYS = {
    "software_context",
    "hardware_context",
    "user_config",
    "diagnosis",
    "optimizations",
    "overall",
    "model_info",
    "compatibility_list",
    "model_sdk",
}


def timing(mean_ms, batch_size=1):
    samples = [mean_ms * 0.9, mean_ms, mean_ms * 1.1]
    return Timing.from_samples(
        samples, warmup=100, method="perf_counter", device="cpu", batch_size=batch_size
    )


def sample_report() -> Report:
    accurate = compare_outputs(torch.ones(3), torch.ones(3))
    moved = compare_outputs(torch.ones(3), torch.ones(3) * 1.5)
    return Report(
        software_context=[{"software": "torch", "version": "2.14.1"}],
        hardware_context={"device_type": "cpu", "device": "cpu", "microarchitecture": "Xeon"},
        user_config={"level": "o1", "device": torch.device("cpu"), "nan": float("nan")},
        diagnosis={"model": "RetinaNet", "test_data_source": "user provided", "message": ""},
        optimizations=[
            PassRecord(
                "channels_last",
                "kept",
                pre_run=10.0,
                post_run=8.0,
                accuracy=accurate,
                reason="faster and accurate",
                timing=timing(8.0),
            ),
            PassRecord(
                "fp16",
                "rejected",
                pre_run=8.0,
                post_run=5.0,
                accuracy=moved,
                reason="outputs moved past tolerance",
                timing=timing(5.0),
            ),
            PassRecord("compile", "failed", reason="[red]RuntimeError: boom"),
            PassRecord("tensorrt", "skipped", reason="not on cpu"),
        ],
        baseline=timing(10.0),
        optimized=timing(8.0),
        accuracy=accurate,
        throughput=[timing(8.0, 1), timing(20.0, 4)],
        model_info={"name": "retinanet", "input_format": "nn.Module", "parameters": np.int64(5)},
        compatibility_list=[{"device_type": "cpu"}],
    )


def test_to_dict_has_pai_blade_keys_and_ours():
    data = sample_report().to_dict()
    assert PAI_BLADE_KEYS <= set(data)
    assert data["timing_method"] == "perf_counter"
    overall = data["overall"]
    assert overall["baseline"] == pytest.approx(10.0)
    assert overall["optimized"] == pytest.approx(8.0)
    assert overall["speedup"] == pytest.approx(1.25)
    assert overall["baseline_timing"]["p99_ms"] > overall["baseline_timing"]["p50_ms"]
    assert overall["accuracy"]["passed"] is True
    first, second = data["optimizations"][:2]
    assert set(first) >= {"name", "status", "speedup", "pre_run", "post_run"}
    assert first["speedup"] == pytest.approx(1.25)  # derived from pre_run / post_run
    assert second["status"] == "rejected" and second["accuracy"]["passed"] is False
    assert "out of tolerance" in second["accuracy"]["summary"]
    assert data["optimizations"][2]["timing"] is None
    assert [t["batch_size"] for t in data["throughput"]] == [1, 4]
    assert data["user_config"] == {"level": "o1", "device": "cpu", "nan": None}
    assert data["model_info"]["parameters"] == 5
    json.dumps(data, allow_nan=False)


def test_json_round_trip(tmp_path):
    report = sample_report()
    path = tmp_path / "reports" / "report.json"
    text = report.to_json(path)
    assert path.read_text() == text
    assert os.listdir(path.parent) == ["report.json"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    again = Report.from_dict(json.loads(text))
    assert again.to_dict() == report.to_dict()
    assert again.optimizations[1].status == "rejected"


def test_pass_record_validates_status():
    with pytest.raises(ValueError, match="status must be one of"):
        PassRecord("x", "effective")


def test_render_shows_passes_statuses_and_overall():
    console = Console(record=True, width=200, file=io.StringIO())
    sample_report().render(console)
    text = console.export_text()
    for expected in (
        "retinanet on cpu (Xeon), level o1",
        "channels_last",
        "fp16",
        "compile",
        "tensorrt",
        "rejected",
        "outputs moved past tolerance",
        "[red]RuntimeError: boom",  # markup in a reason is printed as is
        "1.25x",
        "Timed with perf_counter: 100 warm-up and 3 timed runs",
        "Accuracy passed",
        "Throughput",
    ):
        assert expected in text, expected


def test_render_an_empty_report():
    console = Console(record=True, width=120, file=io.StringIO())
    Report().render(console)
    assert "not measured" in console.export_text()


def test_save_chart_writes_a_png(tmp_path):
    path = tmp_path / "charts" / "latency.png"
    sample_report().save_chart(path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert os.listdir(path.parent) == ["latency.png"]
    Report().save_chart(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes().startswith(b"\x89PNG")


def test_software_context_lists_versions():
    context = {item["software"]: item["version"] for item in software_context()}
    assert {"python", "bladesmith", "torch", "torchvision", "onnxruntime", "cuda"} <= set(context)
    assert context["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert context["cuda"] == torch.version.cuda


def test_hardware_context_cpu():
    context = hardware_context("cpu")
    assert context["device_type"] == "cpu"
    assert context["cpu_cores"] == os.cpu_count()
    assert context["microarchitecture"] == context["cpu_model"] != ""


def test_hardware_context_cuda(monkeypatch):
    properties = types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, total_memory=141 * 2**30
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    context = hardware_context("cuda:0")
    assert context["device_type"] == "gpu"
    assert context["device"] == "cuda:0"
    assert context["microarchitecture"] == "NVIDIA H200"
    assert context["compute_capability"] == "9.0"
    assert context["memory_gb"] == 141.0


def test_render_says_where_each_tolerance_comes_from():
    accuracy = compare_outputs(
        (torch.tensor([[0.0, 0.0, 10.0, 10.0]]), torch.tensor([0.5]), torch.tensor([3])),
        (torch.tensor([[0.0, 0.0, 10.0, 10.0]]), torch.tensor([0.5]), torch.tensor([3])),
        iou_threshold=0.5,
        inputs=[(torch.rand(1, 3, 32, 32),)],
    )
    report = Report(accuracy=accuracy)
    assert report.to_dict()["overall"]["accuracy"]["sources"] == accuracy.sources()
    console = Console(record=True, width=200, file=io.StringIO())
    report.render(console)
    text = console.export_text()
    assert "tolerance of out[0]: IoU 0.5 rule on a 32x32 image" in text
    assert "tolerance of out[1]: the default for float32 outputs" in text
    assert "tolerance of out[2]: exact: int64 outputs must be equal" in text
