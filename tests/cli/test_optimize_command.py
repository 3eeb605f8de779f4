"""`bladesmith optimize`, `bench` and `demo` through the command line's entry point."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from bladesmith.cli import main
from bladesmith.cli import optimize as optimize_cli


@pytest.fixture
def model_file(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    path = tmp_path / "net.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    return path


def test_optimize_a_model_file_then_bench_the_artifacts(tmp_path, model_file, capsys):
    out, report, chart = tmp_path / "opt.pt", tmp_path / "report.json", tmp_path / "chart.png"
    status = main(
        [
            "optimize",
            str(model_file),
            "--device",
            "cpu",
            "--input-size",
            "24x32",
            "--batch",
            "2",
            "--warmup",
            "0",
            "--iters",
            "2",
            "--out",
            str(out),
            "--report",
            str(report),
            "--chart",
            str(chart),
        ]
    )
    assert status == 0
    data = json.loads(report.read_text())
    assert data["overall"]["accuracy"]["passed"]
    assert data["model_info"]["format"] == "TorchScript"
    assert data["model_info"]["input_shapes"] == [[2, 3, 24, 32]]
    records = {record["name"]: record for record in data["optimizations"]}
    assert set(records) >= {"torchscript", "inductor"}
    # --out .pt: ONNX Runtime's result could not be saved so, and is not tried.
    assert records["onnxruntime"]["status"] == "skipped"
    assert "saved as .pt" in records["onnxruntime"]["reason"]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "saved:" in capsys.readouterr().out

    table = tmp_path / "bench.json"
    assert main(["bench", str(out), str(out), "--iters", "2", "--json", str(table)]) == 0
    rows = json.loads(table.read_text())
    assert [row["artifact"] for row in rows] == [str(out), str(out)]
    assert rows[1]["agreement"].startswith("match")
    assert rows[0]["timing"]["iterations"] == 2
    assert rows[0]["runtime"] == {"threads": torch.get_num_threads()}
    # The second timed against the first in alternating rounds: a speedup with its interval.
    low, high = rows[1]["interval"]
    assert low <= high and rows[1]["speedup"].endswith(f"[{low:.2f}-{high:.2f}]")
    printed = capsys.readouterr().out
    assert "Artifacts" in printed and f"ran with threads={torch.get_num_threads()}" in printed


@pytest.mark.slow
def test_several_batch_sizes_give_a_pt2_of_a_model_for_each(tmp_path):
    import bladesmith

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.rand(2, 3, 8, 8),), dynamic_shapes=({0: batch},))
    model_file, out = tmp_path / "net.pt2", tmp_path / "opt.pt2"
    torch.export.save(program, str(model_file))
    flags = ["--device", "cpu", "--input-size", "8x8", "--warmup", "0", "--iters", "1"]
    assert main(["optimize", str(model_file), *flags, "--batch", "4,1", "--out", str(out)]) == 0
    loaded = bladesmith.load(out, trust=True)  # compiled code
    assert loaded.batches == (1, 4) and loaded.spec.input_shapes[0] == (4, 3, 8, 8)
    tolerance = loaded.spec.tolerance  # what the gate judged it at (bf16 may be kept)
    for size in (1, 4):
        x = torch.rand(size, 3, 8, 8)
        torch.testing.assert_close(
            loaded(x), model(x), rtol=tolerance["rtol"], atol=tolerance["atol"]
        )


def test_optimize_reports_a_missing_model_file(tmp_path, capsys):
    assert main(["optimize", str(tmp_path / "missing.pt"), "--device", "cpu"]) == 2
    assert "no such file; expected a built-in model" in capsys.readouterr().err


def test_builtin_detector_gets_a_list_of_photographs():
    args = argparse.Namespace(
        model="torchvision:retinanet_resnet18_fpn", weights=None, batch=(2, 1), input_size=(96, 128)
    )
    model, test_data = optimize_cli._model_and_inputs(args)
    assert [len(images) for (images,) in test_data] == [2, 1]  # an entry per --batch size
    (images,) = test_data[0]
    assert type(model).__name__ == "RetinaNet" and not model.training
    assert len(images) == 2 and images[0].shape == (3, 96, 128)
    assert 0.0 <= float(images[0].min()) and float(images[0].max()) <= 1.0


def test_demo_on_cpu_times_fewer_runs_and_says_so(monkeypatch, capsys):
    seen = {}

    def fake_run_optimize(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(optimize_cli, "run_optimize", fake_run_optimize)
    assert main(["demo", "--device", "cpu"]) == 0
    args = seen["args"]
    assert args.model == optimize_cli.DEFAULT_MODEL and args.input_size == (480, 640)
    assert (args.warmup, args.iters) == optimize_cli.DEMO_CPU_TIMING
    assert "to keep the demo short" in capsys.readouterr().err


def test_bench_gives_no_speedup_between_artifacts_of_different_input_shapes():
    """Before, 0.20x between a batch of 1 and a batch of 8, beside "not compared:
    another input shape"."""
    import torch

    from bladesmith.cli.optimize import _time_side_by_side

    def artifact(shape):
        row = {"device": "cpu", "input_shape": shape}
        return row, None, lambda: torch.ones(64).sum()

    rows = _time_side_by_side(
        [artifact([1, 3, 8, 8]), artifact([8, 3, 8, 8]), artifact([1, 3, 8, 8])], 0, 3
    )
    assert rows[0]["speedup"] == "1.00x"
    assert rows[1]["speedup"] is None and rows[1]["timing"]["iterations"] == 3
    assert rows[2]["speedup"].endswith("]")  # same shape: timed against the first


def test_bench_counts_every_image_of_a_batch_and_says_where_the_first_ran_otherwise():
    import time

    from bladesmith.cli.optimize import _speedup_text, _time_side_by_side

    def artifact(shape, seconds):
        return {"device": "cpu", "input_shape": shape}, None, lambda: time.sleep(seconds)

    batch = [4, 3, 8, 8]
    rows = _time_side_by_side([artifact(batch, 0.004), artifact(batch, 0.002)], 0, 3)
    for row in rows:
        timing = row["timing"]
        assert timing["batch_size"] == 4
        assert timing["throughput"] == pytest.approx(4000 / timing["p50_ms"])
    assert rows[1]["first_p50_ms"] > 0
    row = {"speedup": "2.00x [1.90-2.10]", "first_p50_ms": 8.0}
    assert _speedup_text(row, 8.1) == "2.00x [1.90-2.10]"
    assert _speedup_text(row, 4.0) == "2.00x [1.90-2.10] (the first at 8.00 ms in its rounds)"
