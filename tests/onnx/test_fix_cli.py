"""`bladesmith fix` never shows a traceback: every failure is one line, nothing is
written, and the exit code says which kind of failure it was. `check` groups findings."""

from __future__ import annotations

import json
import os

import check_models as models
import onnx
import pytest
from test_check_validity import INVALID

from bladesmith.cli import main

h = onnx.helper


def save(model, path):
    onnx.save(model, path)
    return path


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


@pytest.mark.parametrize(
    "content", [b"", b"\x08\x01garbage", onnx.ModelProto().SerializeToString()]
)
def test_files_that_are_not_models_exit_2_and_write_nothing(content, tmp_path, capsys):
    source = tmp_path / "in.onnx"
    source.write_bytes(content)
    out = tmp_path / "out.onnx"
    assert models.exit_code(["fix", str(source), str(out), "-t", "tensorrt"]) == 2
    assert str(source) in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("command", ["check", "fix"])
def test_a_missing_external_data_file_is_named_in_one_line(command, tmp_path, capsys):
    source = tmp_path / "model.onnx"
    onnx.save(models.float_resize_sizes(static=True), source, save_as_external_data=True,
              location="model.weights", size_threshold=0)  # fmt: skip
    (tmp_path / "model.weights").unlink()
    out = tmp_path / "out.onnx"
    argv = [command, str(source), *([str(out)] if command == "fix" else []), "-t", "ort-cpu"]
    assert main(argv) == 2
    error = one_line_error(capsys)
    assert "external data file 'model.weights' is missing" in error and str(tmp_path) in error
    assert "export" not in error
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_graphs_exit_2_and_write_nothing(name, tmp_path, capsys):
    source = save(INVALID[name][0](), tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    assert main(["fix", str(source), str(out), "-t", "tensorrt"]) == 2
    assert "valid graphs only" in one_line_error(capsys)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


def test_an_output_that_is_a_folder_or_unwritable_exits_2(tmp_path, capsys):
    source = save(models.relu(), tmp_path / "in.onnx")
    assert models.exit_code(["fix", str(source), str(tmp_path), "-t", "ort-cpu"]) == 2
    assert "is a folder" in one_line_error(capsys)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that may write anywhere")
        argv = ["fix", str(source), str(locked / "out.onnx"), "-t", "ort-cpu"]
        assert models.exit_code(argv) == 2
        assert "not a writable folder" in one_line_error(capsys)
    finally:
        locked.chmod(0o700)


def test_outputs_that_cannot_be_compared_exit_3(tmp_path, capsys):
    source = save(models.relu(static=False), tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    assert main(["fix", str(source), str(out), "-t", "ort-cpu"]) == 3
    assert "verification: unverified" in capsys.readouterr().out and out.exists()
    assert main(["fix", str(source), str(out), "-t", "ort-cpu", "--input-shape", "x:2,3,8,8"]) == 0
    assert main(["fix", str(source), str(out), "-t", "ort-cpu", "--no-verify"]) == 0


def test_an_input_shape_given_twice_is_refused(tmp_path, capsys):
    source = save(models.relu(static=False), tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    shapes = ["--input-shape", "x:2,3,8,8", "--input-shape", "x:1,3,8,8"]
    assert models.exit_code(["fix", str(source), str(out), "-t", "ort-cpu", *shapes]) == 2
    assert "--input-shape: x given twice (x:2,3,8,8 and x:1,3,8,8)" in one_line_error(capsys)
    assert not out.exists()


def test_the_written_model_has_a_new_files_mode(tmp_path):
    source = save(models.relu(), tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    assert main(["fix", str(source), str(out), "-t", "ort-cpu"]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_targets_may_be_separated_by_spaces_or_commas(tmp_path, capsys):
    source = save(models.relu(static=False), tmp_path / "in.onnx")
    assert main(["check", str(source), "-t", "tensorrt", "directml,ort-cpu"]) == 0
    out = capsys.readouterr().out
    assert "tensorrt: dynamic-dim" in out and "directml: dynamic-dim" in out


def int16_max_chain(count):
    """`count` Max nodes on int16, which ONNX Runtime's CPU provider has no kernel for."""
    int16 = onnx.TensorProto.INT16
    nodes = [
        h.make_node("Max", [f"v{i}", "x"], [f"v{i + 1}"], name=f"max{i}") for i in range(count)
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("v0", int16, [2]), h.make_tensor_value_info("x", int16, [2])],
        [h.make_tensor_value_info(f"v{count}", int16, [2])],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])


def test_check_groups_findings_by_rule_and_operator(tmp_path, capsys):
    source = save(int16_max_chain(5), tmp_path / "in.onnx")
    assert main(["check", str(source), "-t", "ort-cpu"]) == 1
    lines = capsys.readouterr().out.splitlines()
    (group,) = [line for line in lines if line.startswith("error:")]
    assert "unsupported-op Max x5 [max0, max1, max2 and 2 more]" in group
    assert "tensor(int16)" in group
    assert lines[-1] == "5 findings, 5 errors"
    assert main(["check", str(source), "-t", "ort-cpu", "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    assert [f["node"] for f in findings] == [f"max{i}" for i in range(5)]
