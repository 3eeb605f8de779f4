"""The user's own operator library, end to end: built with cpp_extension (the session's
``user_library``), called by a scripted model, optimized, saved, benchmarked and loaded
in new processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from bladesmith.errors import BladesmithError
from bladesmith.ops import libraries
from engine_testing import USER_OPERATOR as OPERATOR
from engine_testing import cuda

SIZE = ["--input-size", "24x32", "--warmup", "0", "--iters", "2", "--device", "cpu"]


class UsesTheOperator(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.ops.userops_test.scale_clip(self.bn(self.conv(x)), 2.0, 1.5)


@pytest.fixture(scope="module")
def model_file(user_library, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = UsesTheOperator().eval()
    with torch.no_grad():  # statistics a folded norm changes the weights by
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("model") / "model.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    return path


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A new Python process (no library loaded), with this tree's sources."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run("-m", "bladesmith", *args, cwd=cwd)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "graph(" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _compare_script(artifact: Path, model: Path, shape=(1, 3, 24, 32), tolerance=1e-5) -> str:
    """Python that loads ``artifact`` with no manual library loading, then checks its
    outputs against the scripted model's (whose operator the artifact's load brought)."""
    return textwrap.dedent(
        f"""
        import torch, bladesmith
        optimized = bladesmith.load({str(artifact)!r}, trust=True)
        images = torch.rand({shape})
        model = torch.jit.load({str(model)!r})
        torch.testing.assert_close(
            optimized(images).cpu(), model(images), rtol=10 * {tolerance}, atol={tolerance}
        )
        print("same outputs")
        """
    )


def test_the_operators_a_model_calls_come_from_the_library_that_registers_them(
    user_library, model_file
):
    model = torch.jit.load(str(model_file))
    operators = libraries.operators_called(model)
    assert operators == {OPERATOR}
    assert libraries.libraries_of(operators) == [libraries.Library(user_library, (OPERATOR,))]
    assert libraries.without_fake_kernel(operators) == [OPERATOR]
    eager = UsesTheOperator().eval()
    assert libraries.operators_called(eager, (torch.rand(1, 3, 8, 8),)) == {OPERATOR}


@pytest.mark.slow
def test_optimize_save_bench_and_load_in_new_processes(user_library, model_file, tmp_path):
    out, report = tmp_path / "opt.pt", tmp_path / "report.json"
    flags = ["--load-library", str(user_library), *SIZE]
    result = _cli(
        "optimize",
        str(model_file),
        *flags,
        "--out",
        str(out),
        "--report",
        str(report),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "opt.pt.libs" / "libraries.json").read_text())
    digest = hashlib.sha256(user_library.read_bytes()).hexdigest()
    assert saved == [{"file": user_library.name, "operators": [OPERATOR], "sha256": digest}]
    data = json.loads(report.read_text())
    records = {record["name"]: record for record in data["optimizations"]}
    for name in ("torchscript", "channels_last"):  # applied to TorchScript, then judged
        assert records[name]["status"] in ("kept", "rejected"), records[name]
        assert records[name]["post_run"] is not None
    formats = data["compatibility_list"][0]["save_formats"]
    assert ".pt" in formats and ".pt2" not in formats and ".onnx" not in formats
    assert f"not saved as .onnx: {OPERATOR} has no ONNX translation" in " ".join(
        data["diagnosis"]["notes"]
    )

    bench = _cli("bench", str(out), "--trust", "--warmup", "0", "--iters", "2", cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    loaded = _run("-c", _compare_script(out, model_file), cwd=tmp_path)
    assert loaded.returncode == 0 and "same outputs" in loaded.stdout, loaded.stderr

    (tmp_path / "opt.pt.libs" / user_library.name).unlink()
    error = _one_line_error(_cli("bench", str(out), cwd=tmp_path))
    assert OPERATOR in error and user_library.name in error and "--load-library" in error


def test_onnx_artifact_runs_the_operator_in_onnx_runtime_in_a_new_process(
    user_library, model_file, tmp_path
):
    out = tmp_path / "opt.onnx"
    flags = ["--load-library", str(user_library), "--onnx-op", OPERATOR, *SIZE]
    result = _cli("optimize", str(model_file), *flags, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    loaded = _run("-c", _compare_script(out, model_file), cwd=tmp_path)
    assert loaded.returncode == 0 and "same outputs" in loaded.stdout, loaded.stderr


def test_export_with_an_onnxscript_lowering_runs_as_standard_onnx(
    user_library, model_file, tmp_path
):
    script = textwrap.dedent(
        f"""
        import onnx, onnxscript, torch, bladesmith.onnx
        from onnxscript import opset17 as op
        torch.ops.load_library({str(user_library)!r})

        @onnxscript.script(onnxscript.values.Opset("userops_test", 1))
        def ScaleClip(x, scale: float, limit: float):
            high = op.CastLike(op.Constant(value_float=limit), x)
            return op.Clip(op.Mul(x, op.CastLike(op.Constant(value_float=scale), x)),
                           op.Neg(high), high)

        bladesmith.onnx.register_op("{OPERATOR}", onnxscript=ScaleClip)
        model = torch.jit.load({str(model_file)!r})
        images = torch.rand(2, 3, 24, 32)
        bladesmith.onnx.export(model, (images,), "lowered.onnx")
        nodes = onnx.load("lowered.onnx").graph.node
        assert not [node for node in nodes if node.domain == "ai.onnx.contrib"]
        (out,) = bladesmith.onnx.session("lowered.onnx", device="cpu")(images)
        torch.testing.assert_close(out, model(images), rtol=1e-4, atol=1e-5)
        print("same outputs")
        """
    )
    (tmp_path / "lower.py").write_text(script)  # onnxscript reads its functions' source
    result = _run("lower.py", cwd=tmp_path)
    assert result.returncode == 0 and "same outputs" in result.stdout, result.stderr


def test_missing_library_and_missing_translation_are_one_line(user_library, model_file, tmp_path):
    error = _one_line_error(_cli("optimize", str(model_file), *SIZE, cwd=tmp_path))
    assert OPERATOR in error and "--load-library" in error

    error = _one_line_error(
        _cli(
            "optimize",
            str(model_file),
            "--load-library",
            str(tmp_path / "no.so"),
            *SIZE,
            cwd=tmp_path,
        )
    )
    assert "--load-library" in error and "no.so" in error

    exported = _cli(
        "export",
        "onnx",
        str(model_file),
        str(tmp_path / "m.onnx"),
        "--load-library",
        str(user_library),
        "--input-size",
        "24x32",
        cwd=tmp_path,
    )
    error = _one_line_error(exported)
    assert OPERATOR in error and "bladesmith.onnx.register_op" in error

    from bladesmith.onnx import export

    with pytest.raises(BladesmithError, match="has no ONNX translation") as raised:
        export(torch.jit.load(str(model_file)), (torch.rand(1, 3, 8, 8),), tmp_path / "x.onnx")
    assert "\n" not in str(raised.value)


def test_an_operator_without_fake_kernel_rules_out_pt2_with_a_reason(user_library, tmp_path):
    import bladesmith

    torch.manual_seed(0)
    images = torch.rand(1, 3, 16, 16)
    config = bladesmith.Config(warmup=0, iters=1, progress=False)
    optimized, spec, report = bladesmith.optimize(
        UsesTheOperator().eval(), device="cpu", test_data=[(images,)], config=config
    )
    assert ".pt2" not in spec.save_formats and ".pt" in spec.save_formats
    assert (
        f"not saved as .pt2: torch.export cannot trace {OPERATOR} (no fake kernel"
        in (report.diagnosis["message"])
    )
    saved = bladesmith.save(optimized, tmp_path / "opt.pt")
    assert (tmp_path / "opt.pt.libs" / user_library.name).is_file()
    torch.testing.assert_close(bladesmith.load(saved, trust=True)(images), optimized(images))


class LayersAfterTheOperator(nn.Module):
    """The operator inside the network: a convolution, a ReLU and a mean take its output,
    and each needs its input's dtype and rank to be translated."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = torch.ops.userops_test.scale_clip(self.first(x), 2.0, 1.5)
        return torch.relu(self.second(y)).mean((2, 3))


@pytest.fixture
def registered(user_library, monkeypatch):
    """The operator's default ONNX translation, for this test only."""
    from bladesmith.onnx import user_ops

    monkeypatch.setattr(user_ops, "_TRANSLATIONS", {})
    user_ops.register_op(OPERATOR)


@pytest.mark.parametrize("form", ["eager", "scripted", "traced"])
def test_layers_after_the_operator_export_and_run_in_onnx_runtime(registered, tmp_path, form):
    from bladesmith.onnx import export, session

    torch.manual_seed(0)
    model = LayersAfterTheOperator().eval()
    images = torch.rand(2, 3, 16, 16)
    if form == "scripted":
        model = torch.jit.script(model)
    elif form == "traced":
        model = torch.jit.trace(model, images)
    path = export(model, (images,), tmp_path / "after.onnx")
    (out,) = session(path, device="cpu")(images)
    with torch.no_grad():
        torch.testing.assert_close(out, model(images), rtol=1e-4, atol=1e-5)


@cuda
def test_a_scripted_model_with_the_operator_takes_the_gpu_passes(
    user_library, model_file, tmp_path
):
    import bladesmith

    model = torch.jit.load(str(model_file))
    images = torch.rand(4, 3, 64, 64, device="cuda")
    config = bladesmith.Config(warmup=2, iters=10, progress=False)
    optimized, spec, report = bladesmith.optimize(
        model, device="cuda", test_data=[(images,)], config=config
    )
    records = {record.name: record for record in report.optimizations}
    for name in ("fp16", "channels_last", "torchscript", "cudnn_benchmark", "cuda_graph"):
        assert records[name].status in ("kept", "rejected"), (name, records[name].reason)
    assert report.accuracy["passed"]
    saved = bladesmith.save(optimized, tmp_path / "opt.pt")
    script = _compare_script(saved, model_file, shape=(4, 3, 64, 64), tolerance=1e-2)
    loaded = _run("-c", script, cwd=tmp_path)
    assert loaded.returncode == 0 and "same outputs" in loaded.stdout, loaded.stderr


@pytest.mark.parametrize("form", ["eager", "traced"])
def test_a_free_batch_stays_free_through_the_operator(registered, tmp_path, capfd, form):
    import onnx

    from bladesmith.runtimes.onnxruntime import cpu_runner, export_onnx

    torch.manual_seed(0)
    model = LayersAfterTheOperator().eval()
    images = torch.rand(2, 3, 16, 16)
    if form == "traced":  # its nodes carry the example's batch, 2
        model = torch.jit.trace(model, images)
    path = tmp_path / "free.onnx"
    spec, nones = export_onnx(model, (images,), path)
    (output,) = onnx.load(str(path)).graph.output
    assert output.name == "output_0"
    assert output.type.tensor_type.shape.dim[0].dim_param == "batch"
    capfd.readouterr()
    more = torch.rand(4, 3, 16, 16)
    got = cpu_runner(path, spec, nones)(more)
    assert "does not match" not in capfd.readouterr().err  # ONNX Runtime's shape warning
    with torch.no_grad():
        torch.testing.assert_close(got, model(more), rtol=1e-4, atol=1e-5)
