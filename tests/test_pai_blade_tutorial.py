"""PAI-Blade's PyTorch tutorial, as docs/pai-blade.md ports it, runs on bladesmith: the page's
block itself, on a small model (ResNet-18 at 64x64), on the GPU when there is one."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith.errors import BladesmithError
from bladesmith.passes import Pass
from bladesmith.passes.onnxruntime import OnnxRuntime
from engine_testing import Wasteful

PAGE = Path(__file__).resolve().parents[1] / "docs" / "pai-blade.md"
SRC = Path(__file__).resolve().parents[1] / "src"
BLOCK = re.compile(r"<!-- pai-blade-tutorial -->\n```python\n(.*?)```", re.DOTALL)


def tutorial_code() -> tuple[str, str]:
    """The page's tutorial block on a small model, for this machine: (optimizing part,
    deployment part)."""
    code = BLOCK.search(PAGE.read_text()).group(1)
    code = code.replace("resnet50()", "resnet18()").replace("224, 224", "64, 64")
    if not torch.cuda.is_available():
        code = code.replace(".cuda()", "").replace('"gpu"', '"cpu"')
    optimizing, deployment = code.split("\n# Deployment")
    return optimizing, deployment.split("\n", 1)[1]  # without the comment line


def run_python(code: str, directory: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_the_readme_tutorial_runs_and_deploys_in_a_new_process(tmp_path):
    optimizing, deployment = tutorial_code()
    # Quick timing; ONNX Runtime and OpenVINO left out so that the result is TorchScript
    # (the refusal of .pt for a result that runs in another runtime is the next test's).
    harness = (
        "import bladesmith\n"
        "with bladesmith.Config(warmup=1, iters=3, "
        "exclude=['onnxruntime', 'openvino', 'openvino_f32']):\n"
        + "".join(f"    {line}\n" for line in optimizing.splitlines())
        + "torch.save(dummy, 'dummy.pt'); torch.save(optimized_model(dummy), 'expected.pt')\n"
    )
    result = run_python(harness, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report_text = result.stdout.split("report: ", 1)[1]
    report = json.loads(report_text)
    for key in ("software_context", "hardware_context", "optimizations", "overall"):
        assert key in report
    assert (tmp_path / "optimized.pt").is_file()

    # Within the tolerance the report states: float32's, or, where a half-precision pass
    # was kept (bf16 on a CPU that computes in it), that type's, as the save was verified.
    rtol, atol = report["tolerance"]["rtol"], report["tolerance"]["atol"]
    deploy = (
        "import torch\ndummy = torch.load('dummy.pt')\n"
        + deployment
        + "\ntorch.testing.assert_close(output, torch.load('expected.pt'), "
        + f"rtol={max(rtol, 1e-4)}, atol={max(atol, 1e-4)})\n"
    )
    deployed = run_python(deploy, tmp_path)
    assert deployed.returncode == 0, deployed.stderr[-3000:]


@pytest.mark.slow
def test_an_onnx_runtime_result_refuses_pt_and_saves_onnx_for_any_batch(tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)
    )
    model(torch.randn(1, 3, 8, 8))
    # Wasteful: ONNX Runtime must win whatever the load of the machine, or this test of
    # what its result saves would see the result run eager.
    model = Wasteful(model).eval()
    config = bladesmith.Config(warmup=0, iters=2, progress=False)
    optimized, spec, _ = bladesmith.optimize(
        model,
        "o1",
        device_type="cpu",
        test_data=[torch.randn(1, 3, 8, 8)],
        config=config,
        passes=[OnnxRuntime()],
    )
    assert spec.backend == "onnxruntime"
    assert ".pt" not in spec.save_formats and "ONNX Runtime" in spec.refused_formats[".pt"]
    with pytest.raises(BladesmithError, match=r"bladesmith\.save"):
        torch.jit.save(optimized, str(tmp_path / "optimized.pt"))
    with pytest.raises(BladesmithError, match="refused"):
        bladesmith.save(optimized, tmp_path / "optimized.pt")
    assert spec.save_formats[0] == ".onnx"
    bladesmith.save(optimized, tmp_path / "optimized.onnx")
    batch = torch.randn(2, 3, 8, 8)  # built on a batch of 1
    with torch.no_grad():
        torch.save((batch, model(batch), optimized(batch)), tmp_path / "io.pt")
    check = (
        "import torch, bladesmith\n"
        "batch, expected, optimized = torch.load('io.pt')\n"
        "loaded = bladesmith.load('optimized.onnx')(batch)\n"
        "torch.testing.assert_close(optimized, expected, rtol=1e-4, atol=1e-5)\n"
        "torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)\n"
    )
    result = run_python(check, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_device_type_and_device_cannot_disagree():
    with pytest.raises(ValueError, match="device_type"):
        bladesmith.optimize(
            nn.Linear(2, 2), device="cpu", device_type="gpu", test_data=[torch.ones(1, 2)]
        )


class RoughHalf(Pass):
    """A precision pass whose rounding moves the outputs past the gate (weights off by
    5%), on any device."""

    name = "rough_half"
    changes_precision = True
    devices = ("cpu", "cuda")

    def apply(self, candidate, context):
        module = copy.deepcopy(candidate.module)
        with torch.no_grad():
            module.weight.mul_(1.05)
        return candidate.with_module(module, self.name, dtype=torch.float16)


def test_the_tutorials_config_assignments_disable_the_half_precision_check():
    # PAI-Blade's tutorial: blade_config.gpu_config.disable_fp16_accuracy_check = True,
    # then `with blade_config:` (before, the assignment raised: Config was frozen).
    torch.manual_seed(0)
    model, data = nn.Linear(8, 4).eval(), [torch.randn(2, 8)]
    device_type = "gpu" if torch.cuda.is_available() else "cpu"
    # Speed is not judged here: a bar near zero, so that one preempted run of a few
    # microseconds cannot put the interval under it (as on a loaded 2-core machine).
    quick = dict(warmup=0, iters=2, min_speedup=1e-6, progress=False)

    checked = bladesmith.Config(**quick)
    with checked:
        _, _, report = bladesmith.optimize(
            model, "o1", device_type=device_type, test_data=data, passes=[RoughHalf()]
        )
    (record,) = report.optimizations
    assert record.status == "rejected" and "past tolerance" in record.reason

    blade_config = bladesmith.Config(**quick)
    blade_config.gpu_config.disable_fp16_accuracy_check = True
    assert (
        blade_config.disable_fp16_accuracy_check
        and blade_config.gpu_config.disable_fp16_accuracy_check
    )
    with blade_config:
        _, spec, report = bladesmith.optimize(
            model, "o1", device_type=device_type, test_data=data, passes=[RoughHalf()]
        )
    (record,) = report.optimizations
    assert record.status == "kept" and "accuracy check disabled" in record.reason
    assert spec.passes == ("rough_half",)
    assert report.user_config["disable_fp16_accuracy_check"] is True


def test_config_assignments_are_checked_as_the_constructor_checks_them():
    config = bladesmith.Config()
    config.min_speedup = 1.1
    config.exclude = "onnxruntime"
    assert config.min_speedup == 1.1 and config.exclude == ("onnxruntime",)
    with pytest.raises(ValueError, match="min_speedup: expected a number > 0, got 0"):
        config.min_speedup = 0
    assert config.min_speedup == 1.1
    with pytest.raises(AttributeError, match="no setting 'min_speed'"):
        config.min_speed = 2
    with pytest.raises(AttributeError, match=r"gpu_config has no setting 'enable_fp16'"):
        config.gpu_config.enable_fp16 = True
