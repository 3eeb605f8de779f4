"""Building, caching and loading the operator library; the `bladesmith ops` command."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from bladesmith.cli import main
from bladesmith.errors import OpsBuildError
from bladesmith.ops import build, library_path, load_library


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_status_of_the_loaded_library():
    status = build.status()
    assert (status.built, status.loadable, status.path) == (True, True, library_path())
    assert Path(status.path).is_file() and status.path in torch.ops.loaded_libraries


def test_status_in_a_fresh_process_loads_the_cached_library_without_building():
    result = run_python(
        "from bladesmith.ops.build import status; s = status(); print(s.built, s.loadable)"
    )
    assert result.stdout.split() == ["True", "True"], result.stderr
    assert "building" not in result.stderr


def test_cache_key_follows_sources_and_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("BLADESMITH_CACHE", str(tmp_path / "cache"))
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    (csrc / "cuda").mkdir(exist_ok=True)
    (csrc / "cuda" / "extra.cu").write_text("// one\n")
    monkeypatch.setattr(build, "CSRC", csrc)

    cpu, cuda = build.status(cuda=False), build.status(cuda=True)
    assert not cpu.built and cpu.loadable is None and "not built" in cpu.detail
    assert Path(cpu.path).parent.parent == tmp_path / "cache" / "ops"
    assert Path(cpu.path).parent.name.startswith("cpu-")
    assert Path(cuda.path).parent.name.startswith("cuda-")

    (csrc / "cuda" / "extra.cu").write_text("// two\n")  # CPU build unaffected
    assert build.status(cuda=False).path == cpu.path
    assert build.status(cuda=True).path != cuda.path
    (csrc / "checks.h").write_text((csrc / "checks.h").read_text() + "\n")
    assert build.status(cuda=False).path != cpu.path


def test_environment_chooses_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("BLADESMITH_CACHE", str(tmp_path))
    monkeypatch.setenv("BLADESMITH_OPS_CUDA", "1")
    assert Path(build.status().path).parent.name.startswith("cuda-")
    monkeypatch.setenv("BLADESMITH_OPS_CUDA", "0")
    assert Path(build.status().path).parent.name.startswith("cpu-")
    monkeypatch.setenv("BLADESMITH_OPS_CUDA", "yes")
    status = build.status()
    assert not status.built and "BLADESMITH_OPS_CUDA: expected 0 or 1" in status.detail


def test_status_names_missing_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("BLADESMITH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert "no C++ compiler" in build.status(cuda=False).detail
    detail = build.status(cuda=True).detail
    assert "no-such-compiler" in detail and "no nvcc" in detail


def test_missing_compiler_is_a_clear_error(tmp_path):
    result = run_python(
        "from bladesmith.cli import main; raise SystemExit(main(['ops', 'build', '--no-cuda']))",
        BLADESMITH_CACHE=str(tmp_path),
        CXX=str(tmp_path / "no-such-c++"),
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot build the operator library: no C++ compiler")
    assert "no-such-c++" in result.stderr and "Traceback" not in result.stderr


def test_another_configuration_in_the_same_process_is_refused():
    with pytest.raises(OpsBuildError, match="already loaded in this process"):
        load_library(cuda=not build.want_cuda())


def test_command_prints_the_library_path(capsys):
    assert main(["ops", "build"]) == 0
    assert capsys.readouterr().out.strip() == library_path()


def test_importing_the_package_does_not_import_torch():
    result = run_python("import sys, bladesmith.ops; print('torch' in sys.modules)")
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("operator", ["retinanet_decode", "batched_nms", "retinanet_postprocess"])
def test_every_backend_has_a_kernel(operator):
    name = f"bladesmith::{operator}"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    # Devices without their own kernels run on the CPU and copy back (fallback.cpp).
    assert has(name, "PrivateUse1") and has(name, "MPS") and has(name, "Meta")
    if operator == "retinanet_postprocess":
        assert has(name, "CompositeExplicitAutograd")
    else:
        assert has(name, "CPU")
