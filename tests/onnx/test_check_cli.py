"""`bladesmith check` and `bladesmith fix`: exit codes, text and --json output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import check_models as models
import onnx
import pytest

from bladesmith.cli import EXIT_BROKEN_PIPE, main


@pytest.fixture
def dynamic_model(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(models.float_resize_sizes(), path)
    return path


def test_check_exits_1_on_errors_and_names_rule_and_node(dynamic_model, capsys):
    assert main(["check", str(dynamic_model), "--target", "tensorrt"]) == 1
    out = capsys.readouterr().out
    assert "error: tensorrt: float-shape-arithmetic [resize]" in out
    assert "hint:" in out and "1 errors" in out


def test_check_exits_0_without_errors_and_takes_several_targets(tmp_path, capsys):
    path = tmp_path / "relu.onnx"
    onnx.save(models.relu(static=False), path)
    assert main(["check", str(path), "-t", "tensorrt,directml", "-t", "ort-cpu"]) == 0
    out = capsys.readouterr().out
    assert "info: tensorrt: dynamic-dim" in out and "warning: directml: dynamic-dim" in out


def test_check_json(dynamic_model, capsys):
    assert main(["check", str(dynamic_model), "--target", "all", "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    rules = {(f["target"], f["rule"], f["node"]) for f in findings}
    assert ("tensorrt", "float-shape-arithmetic", "resize") in rules
    assert ("directml", "dynamic-dim", None) in rules
    assert set(findings[0]) >= {"rule", "severity", "target", "node", "message", "hint"}


def test_fix_writes_the_model_and_exits_0_when_no_errors_remain(dynamic_model, tmp_path, capsys):
    out = tmp_path / "fixed.onnx"
    code = main(
        ["fix", str(dynamic_model), str(out), "-t", "tensorrt", "--input-shape", "x:1,3,8,8"]
    )
    assert code == 0 and out.exists()
    text = capsys.readouterr().out
    assert "applied: constant-fold" in text and "verification: passed" in text
    assert main(["check", str(out), "-t", "tensorrt"]) == 0


def test_fix_json_reports_rewrites_and_remaining_findings(dynamic_model, tmp_path, capsys):
    code = main(["fix", str(dynamic_model), str(tmp_path / "f.onnx"), "-t", "tensorrt", "--json"])
    assert code == 3  # fixed, no errors left, but dynamic inputs: the outputs were not compared
    result = json.loads(capsys.readouterr().out)
    assert result["applied"][0]["kind"] == "integer-shape-arithmetic"
    assert [f["rule"] for f in result["remaining"]] == ["dynamic-dim"]
    assert (result["passed"], result["verification"]["status"]) == (False, "unverified")
    argv = ["fix", str(dynamic_model), str(tmp_path / "f.onnx"), "-t", "tensorrt", "--json"]
    assert main([*argv, "--input-shape", "x:1,3,8,8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["passed"], result["verification"]["status"]) == (True, "passed")


def test_fix_exits_1_when_errors_remain(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save(models.plugin_feeds_reshape(), path)
    code = main(["fix", str(path), str(tmp_path / "f.onnx"), "-t", "tensorrt", "--no-verify"])
    assert code == 1
    assert "plugin-shape-input" in capsys.readouterr().out


def test_bad_arguments(dynamic_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fix",
                str(dynamic_model),
                str(tmp_path / "f.onnx"),
                "-t",
                "tensorrt",
                "--input-shape",
                "x:a,b",
            ]
        )
    assert exit_info.value.code == 2
    assert main(["check", str(dynamic_model), "-t", "tpu"]) == 2
    assert "unknown target 'tpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["check", str(dynamic_model)])  # --target is required


def test_a_closed_stdout_ends_check_quietly(dynamic_model):
    """`bladesmith check --json m.onnx | head`: the reader goes away; no error, no
    traceback, the exit status of a command stopped by SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails with EPIPE
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "bladesmith", "check", str(dynamic_model), "-t", "all"]
    try:
        done = subprocess.run(
            [*argv, "--json"], stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=300
        )
    finally:
        os.close(write_end)
    assert done.stderr.decode() == ""
    assert done.returncode == EXIT_BROKEN_PIPE
