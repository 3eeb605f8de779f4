"""The doctor's checks, fed fake machines: packages, site directories, toolchains."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import types
import venv
from pathlib import Path

import pytest
import torch

from bladesmith.environment import (
    OpsStatus,
    Tool,
    Toolchain,
    check_binary_pth,
    check_build_tools,
    check_cuda_toolkit,
    check_onnxruntime_variants,
    check_torch,
    check_torch_torchvision,
    find_binary_pth_files,
)

doctor_module = importlib.import_module("bladesmith.environment")

posix_only = pytest.mark.skipif(os.name == "nt", reason="uses a POSIX venv layout and shell")


def make_venv(root: Path) -> tuple[str, Path]:
    """A bare virtual environment: (its python, its site-packages)."""
    builder = venv.EnvBuilder(with_pip=False, symlinks=True)
    builder.create(root)
    python = builder.ensure_directories(root).env_exe
    site_packages = run_python(python, "import sysconfig; print(sysconfig.get_path('purelib'))")
    return python, Path(site_packages.stdout.strip())


def run_python(python: str, code: str) -> subprocess.CompletedProcess:
    # UTF-8 mode: site decodes .pth files with the locale's encoding, which then is UTF-8.
    env = {**os.environ, "PYTHONUTF8": "1"}
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)


@posix_only
def test_binary_pth_in_site_packages_stops_python_and_the_doctor_names_it(tmp_path):
    python, site_packages = make_venv(tmp_path / "env")
    assert run_python(python, "pass").returncode == 0
    weights = site_packages / "model.pth"
    torch.save({"weight": torch.arange(16.0)}, weights)

    broken = run_python(python, "pass")
    assert broken.returncode != 0
    assert "UnicodeDecodeError" in broken.stderr

    [pitfall] = check_binary_pth([site_packages])
    assert (pitfall.id, pitfall.severity) == ("binary-pth", "error")
    assert str(weights) in pitfall.message
    assert "model.pt" in pitfall.fix

    # The fix works: renamed to .pt, the interpreter starts and the doctor is satisfied.
    weights.rename(weights.with_suffix(".pt"))
    assert run_python(python, "pass").returncode == 0
    assert check_binary_pth([site_packages]) == []


def test_only_non_text_pth_files_are_flagged(tmp_path):
    (tmp_path / "paths.pth").write_text("/opt/lib\nimport os\n", encoding="utf-8")
    (tmp_path / "bom.pth").write_bytes("\ufeff/opt/ünïcode\n".encode("utf-8-sig"))
    (tmp_path / "empty.pth").write_bytes(b"")
    (tmp_path / "folder.pth").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\x80\x81")  # not a .pth: site ignores it
    (tmp_path / "latin1.pth").write_bytes(b"/opt/caf\xe9\n")
    (tmp_path / "nul.pth").write_bytes(b"/opt/lib\x00\n")
    found = find_binary_pth_files([tmp_path, tmp_path / "missing"])
    assert found == [tmp_path / "latin1.pth", tmp_path / "nul.pth"]


def test_site_directories_include_this_environments_site_packages():
    directories = doctor_module.site_directories()
    assert Path(sysconfig.get_path("purelib")) in directories
    assert len(directories) == len(set(directories))


def test_onnxruntime_variants_shadowing_each_other():
    assert check_onnxruntime_variants({"onnxruntime": "1.20.1", "numpy": "2.0"}) == []
    packages = {"onnxruntime": "1.20.1", "onnxruntime-gpu": "1.20.1", "onnx": "1.17"}
    [pitfall] = check_onnxruntime_variants(packages)
    assert (pitfall.id, pitfall.severity) == ("onnxruntime-shadowed", "error")
    assert "onnxruntime 1.20.1, onnxruntime-gpu 1.20.1" in pitfall.message
    assert pitfall.fix.startswith("pip uninstall -y onnxruntime onnxruntime-gpu,")
    [pitfall] = check_onnxruntime_variants(
        {"onnxruntime-gpu": "1.2", "onnxruntime-directml": "1.2"}
    )
    assert "onnxruntime-gpu onnxruntime-directml" in pitfall.fix


@pytest.mark.parametrize(
    ("torch_version", "vision_version", "expected_ids"),
    [
        ("2.6.0+cu124", "0.21.0+cu124", []),
        ("2.14.1+cu130", "0.29.1+cu130", []),
        ("2.11.0", "0.26.0", []),
        ("1.13.1", "0.14.1", []),
        ("2.7.0.dev20250301+cu128", "0.22.0.dev20250301+cu128", []),
        ("2.6.0", "0.20.1", ["torch-torchvision-version"]),
        ("2.14.1+cu130", "0.29.1+cpu", ["torch-torchvision-build"]),
        ("2.5.1+cu124", "0.21.0+cpu", ["torch-torchvision-version", "torch-torchvision-build"]),
        ("2.6.0+cu124", "0.21.0", []),  # no tag on one side: nothing to compare
    ],
)
def test_torch_torchvision_pairing(torch_version, vision_version, expected_ids):
    pitfalls = check_torch_torchvision({"torch": torch_version, "torchvision": vision_version})
    assert [pitfall.id for pitfall in pitfalls] == expected_ids
    assert all(pitfall.severity == "error" for pitfall in pitfalls)


def test_torch_torchvision_fixes_name_the_right_versions():
    [version] = check_torch_torchvision({"torch": "2.6.0", "torchvision": "0.20.1"})
    assert "needs torchvision 0.21" in version.message
    assert version.fix == 'pip install "torchvision==0.21.*"'
    [build] = check_torch_torchvision({"torch": "2.14.1+cu130", "torchvision": "0.29.1+cpu"})
    assert "(cu130 vs cpu)" in build.message
    assert '"torchvision==0.29.1" --index-url https://download.pytorch.org/whl/cu130' in build.fix
    assert check_torch_torchvision({"torch": "2.6.0"}) == []


def test_torch_missing_or_too_old():
    assert [p.id for p in check_torch({})] == ["torch-missing"]
    assert [p.id for p in check_torch({"torch": "2.5.1+cu124"})] == ["torch-too-old"]
    assert check_torch({"torch": "2.6.0"}) == []


def test_installed_packages_match_what_python_imports():
    import torchvision

    packages = doctor_module.installed_packages()
    assert packages["torch"] == torch.__version__
    assert packages["torchvision"] == torchvision.__version__
    assert packages["onnx"] == importlib.metadata.version("onnx")
    assert all(name == doctor_module.normalize_name(name) for name in packages)


@pytest.mark.parametrize(
    ("torch_cuda", "nvcc_cuda", "expected"),
    [
        ("13.0", "13.0", []),
        ("13.0", "12.8", [("nvcc-cuda-major", "error")]),
        ("12.6", "12.8", [("nvcc-cuda-minor", "warning")]),
        (None, "12.8", []),
        ("12.8", None, []),
    ],
)
def test_nvcc_against_torchs_cuda(torch_cuda, nvcc_cuda, expected):
    pitfalls = check_cuda_toolkit(torch_cuda, nvcc_cuda)
    assert [(pitfall.id, pitfall.severity) for pitfall in pitfalls] == expected


@posix_only
def test_nvcc_is_found_through_cuda_home_and_its_version_parsed(tmp_path, monkeypatch):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Cuda compilation tools, release 12.8, V12.8.93'\n"
    )
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    toolchain = doctor_module.collect_toolchain(torch_cuda="13.0")
    assert (toolchain.nvcc.path, toolchain.nvcc.version) == (str(nvcc), "12.8.93")
    assert (toolchain.nvcc_cuda, toolchain.nvcc_matches_torch) == ("12.8", False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    assert "has no bin/nvcc" in doctor_module.find_nvcc().detail


def test_compiler_named_by_cxx_must_exist(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler++")
    compiler = doctor_module.find_compiler()
    assert compiler.path is None
    assert "torch builds with no-such-compiler++, not on PATH" in compiler.detail


def toolchain(compiler=True, ninja=True, nvcc=True, built=False) -> Toolchain:
    def tool(name, found):
        return Tool(name, f"/usr/bin/{name}" if found else None, "1" if found else None, "why")

    return Toolchain(
        compiler=tool("c++", compiler),
        ninja=tool("ninja", ninja),
        nvcc=tool("nvcc", nvcc),
        torch_cuda="13.0",
        nvcc_cuda="13.0" if nvcc else None,
        nvcc_matches_torch=True if nvcc else None,
        ops=OpsStatus(True, built=built),
    )


def test_missing_build_tools_are_errors_until_the_operators_are_built():
    assert check_build_tools(toolchain(), cuda_gpus=1) == []
    missing = check_build_tools(toolchain(compiler=False, ninja=False), cuda_gpus=0)
    assert [(p.id, p.severity) for p in missing] == [
        ("no-cxx-compiler", "error"),
        ("no-ninja", "error"),
    ]
    built = check_build_tools(toolchain(compiler=False, ninja=False, built=True), cuda_gpus=0)
    assert {p.severity for p in built} == {"warning"}
    assert [p.id for p in check_build_tools(toolchain(nvcc=False), cuda_gpus=1)] == ["no-nvcc"]
    assert check_build_tools(toolchain(nvcc=False), cuda_gpus=0) == []
    broken = toolchain(built=True)
    broken.ops = OpsStatus(True, True, "/cache/ops.so", False, "undefined symbol: _ZN3c10")
    [pitfall] = check_build_tools(broken, cuda_gpus=0)
    assert (pitfall.id, pitfall.severity) == ("ops-not-loadable", "error")
    assert "/cache/ops.so" in pitfall.message and "undefined symbol" in pitfall.message


def build_module(monkeypatch, **attributes) -> None:
    module = types.ModuleType("bladesmith.ops.build")
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, "bladesmith.ops.build", module)


def test_ops_status_reports_what_the_build_module_says(monkeypatch):
    found = types.SimpleNamespace(built=True, path="/cache/ops.so", loadable=False, detail="why")
    build_module(monkeypatch, status=lambda: found)
    assert doctor_module.ops_status() == OpsStatus(True, True, "/cache/ops.so", False, "why")


def test_ops_status_without_a_usable_build_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "bladesmith.ops.build", None)
    assert doctor_module.ops_status().detail == "ops build module not available"
    build_module(monkeypatch)
    assert not doctor_module.ops_status().available

    def broken():
        raise RuntimeError("cache unreadable")

    build_module(monkeypatch, status=broken)
    assert doctor_module.ops_status().detail == "status() failed: RuntimeError: cache unreadable"


def test_doctor_reports_this_machine(tmp_path):
    import onnxruntime

    (tmp_path / "model.pth").write_bytes(b"PK\x03\x04\x80\x00binary")
    result = doctor_module.doctor(site_dirs=[tmp_path])
    report = json.loads(json.dumps(result.to_dict()))
    versions = {package["name"]: package["version"] for package in report["packages"]}
    assert versions["torch"] == torch.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["devices"][-1]["kind"] == "cpu"
    assert report["providers"] == onnxruntime.get_available_providers()
    assert report["toolchain"]["torch_cuda"] == torch.version.cuda
    flagged = [p for p in report["pitfalls"] if p["id"] == "binary-pth"]
    assert [str(tmp_path / "model.pth") in p["message"] for p in flagged] == [True]
    severities = [doctor_module.SEVERITIES.index(p["severity"]) for p in report["pitfalls"]]
    assert severities == sorted(severities)
    assert result.errors == [p for p in result.pitfalls if p.severity == "error"]


def test_directml_pitfall_names_the_torch_it_pins():
    packages = {"torch": "2.11.0+cu130", "torch-directml": "0.2.5.dev240914"}
    pitfall = doctor_module.directml_pitfall(
        packages, "torch-directml fails to import: DLL load failed", ["torch==2.4.1", "numpy"]
    )
    assert (pitfall.id, pitfall.severity) == ("directml-unusable", "warning")
    assert pitfall.message.endswith("DLL load failed; torch-directml requires torch 2.4.1")
    assert "older than bladesmith supports" in pitfall.fix
    assert "pip install onnxruntime-directml" in pitfall.fix
    unpinned = doctor_module.directml_pitfall(packages, "no device", [])
    assert unpinned.message == "DirectML is not usable: no device"


def test_doctor_reports_directml_that_finds_no_device(monkeypatch):
    fake = types.ModuleType("torch_directml")
    fake.device_count = lambda: 0
    monkeypatch.setitem(sys.modules, "torch_directml", fake)
    packages = {**doctor_module.installed_packages(), "torch-directml": "0.2.5.dev240914"}
    monkeypatch.setattr(doctor_module, "installed_packages", lambda: packages)
    result = doctor_module.doctor()
    [pitfall] = [p for p in result.pitfalls if p.id == "directml-unusable"]
    assert "finds no DirectML device" in pitfall.message
    assert {"name": "torch-directml", "version": "0.2.5.dev240914", "detail": ""} in [
        dataclasses.asdict(package) for package in result.packages
    ]


def test_a_virtual_environments_root_stands_for_its_site_packages(tmp_path, capsys):
    from bladesmith.cli import main

    root = tmp_path / "env"
    site_packages = root / "lib" / "python3.11" / "site-packages"
    site_packages.mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    weights = site_packages / "model.pth"
    weights.write_bytes(b"\x80\x02}q\x00binary weights")
    assert main(["doctor", "--json", "--site-dir", str(root)]) == 1
    report = json.loads(capsys.readouterr().out)
    [pitfall] = [p for p in report["pitfalls"] if p["id"] == "binary-pth"]
    assert str(weights) in pitfall["message"]
