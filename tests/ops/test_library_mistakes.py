"""The user's operator libraries given wrong: two builds of one namespace (which abort
the process once both are loaded), another version's schema, no kernel for the device,
another library than the model's, a folder. Each is one line naming the files. The
libraries are built in their own processes: two of them must never meet in one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bladesmith.cli import main
from bladesmith.errors import BladesmithError, ModelRunError
from bladesmith.ops import libraries

_HEADER = "#include <ATen/ATen.h>\n#include <torch/library.h>\n"
SOURCES = {
    "checked_ops": _HEADER
    + r"""
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {
  return x * alpha + y;
}
at::Tensor halve(const at::Tensor& x) { return x / 2; }
TORCH_LIBRARY(checked_ops, m) {
  m.def("scale_add(Tensor x, Tensor y, float alpha) -> Tensor");
  m.def("halve(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(checked_ops, CPU, m) {
  m.impl("scale_add", scale_add);
  m.impl("halve", halve);
}
""",
    # Another version of the same library: the same namespace, another schema, one
    # operator fewer.
    "checked_ops_v2": _HEADER
    + r"""
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y) { return x + y; }
TORCH_LIBRARY(checked_ops, m) { m.def("scale_add(Tensor x, Tensor y) -> Tensor"); }
TORCH_LIBRARY_IMPL(checked_ops, CPU, m) { m.impl("scale_add", scale_add); }
""",
    # CUDA kernels for checked_ops in a library of their own: TORCH_LIBRARY_IMPL may
    # share a namespace that another library defines.
    "checked_ops_cuda": _HEADER
    + r"""
at::Tensor halve(const at::Tensor& x) { return x / 2; }
TORCH_LIBRARY_IMPL(checked_ops, CUDA, m) { m.impl("halve", halve); }
""",
    # Kernels for checked_ops whose loading kills the process where CRASH_ON_LOAD is set
    # (not in the build, which loads what it built).
    "crashing_ops": "#include <cstdlib>\n"
    + _HEADER
    + r"""
static const int crash = std::getenv("CRASH_ON_LOAD") ? (std::abort(), 0) : 0;
at::Tensor halve(const at::Tensor& x) { return x / 2 + crash; }
TORCH_LIBRARY_IMPL(checked_ops, CUDA, m) { m.impl("halve", halve); }
""",
    # Another namespace, with a CUDA kernel only.
    "gpu_only_ops": _HEADER
    + r"""
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(gpu_only_ops, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(gpu_only_ops, CUDA, m) { m.impl("twice", twice); }
""",
}
SIZE = ["--input-size", "8x8", "--warmup", "0", "--iters", "1", "--device", "cpu"]
# Every test needs the five libraries compiled (minutes on two cores).
pytestmark = pytest.mark.slow

_BUILD = """
import sys, torch
from torch.utils.cpp_extension import load_inline
name, source, folder = sys.argv[1:]
load_inline(name, cpp_sources=[source], is_python_module=False, build_directory=folder)
if name == "checked_ops":  # a model that calls the operator, scripted where it is loaded
    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.ops.checked_ops.halve(torch.ops.checked_ops.scale_add(x, x, 2.0))
    torch.jit.script(Model()).save(f"{folder}/model.pt")
"""


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A new Python process (no library loaded), with this tree's sources."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Each library's file (by name), built side by side in processes of their own, and
    ``model``: a scripted model calling checked_ops::scale_add and halve."""
    root = tmp_path_factory.mktemp("libraries")
    (root / "build.py").write_text(_BUILD)  # TorchScript reads the model's source
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    builds = {}
    for name, source in SOURCES.items():
        (root / name).mkdir()
        command = [sys.executable, str(root / "build.py"), name, source, str(root / name)]
        builds[name] = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    for build in builds.values():
        _, err = build.communicate(timeout=600)
        assert build.returncode == 0, err
    return {name: root / name / f"{name}.so" for name in SOURCES} | {
        "model": root / "checked_ops" / "model.pt"
    }


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr  # not 134: the process was not aborted
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr
    # Under --trust, what is trusted is said first, on a line of its own.
    said = [line for line in result.stderr.splitlines() if line.strip()]
    lines = [line for line in said if not line.startswith("bladesmith: trusting")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_the_namespaces_a_library_defines_are_read_from_its_binary(built):
    assert libraries.defined_namespaces(built["checked_ops"]) == {"checked_ops"}
    assert libraries.defined_namespaces(built["checked_ops_v2"]) == {"checked_ops"}
    assert libraries.defined_namespaces(built["gpu_only_ops"]) == {"gpu_only_ops"}
    assert libraries.defined_namespaces(built["checked_ops_cuda"]) == set()  # kernels only


def test_stripped_libraries_of_one_namespace_are_refused_and_kernels_for_it_load(built, tmp_path):
    """strip removes the symbol table, whose names of TORCH_LIBRARY's static objects told
    which namespaces a library defines: a stripped second build aborted the process."""
    if shutil.which("strip") is None:
        pytest.skip("needs binutils' strip")
    stripped = {}
    for name in ("checked_ops", "checked_ops_v2", "checked_ops_cuda"):
        stripped[name] = Path(shutil.copy(built[name], tmp_path / f"stripped_{name}.so"))
        subprocess.run(["strip", "--strip-all", str(stripped[name])], check=True)
        assert libraries.defined_namespaces(stripped[name]) is None  # what they told is gone
    for first, second in (
        (built["checked_ops"], stripped["checked_ops_v2"]),
        (stripped["checked_ops"], built["checked_ops_v2"]),
        (stripped["checked_ops"], stripped["checked_ops_v2"]),
    ):
        flags = ["--load-library", str(first), "--load-library", str(second)]
        error = _one_line_error(
            _run("-m", "bladesmith", "optimize", str(built["model"]), *flags, *SIZE, cwd=tmp_path)
        )
        assert f"--load-library {second}: it defines the operator namespace checked_ops" in error
        assert f"which {first} defines too" in error and "load only one of them" in error
    script = "import sys; from bladesmith.ops import libraries; libraries.load_all(sys.argv[1:])"
    kernels = [str(stripped["checked_ops"]), str(stripped["checked_ops_cuda"])]
    loaded = _run("-c", script, *kernels, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr


def test_a_stripped_library_of_kernels_alone_is_not_blamed_for_a_definition(
    built, tmp_path, tmp_path_factory
):
    """A stripped library names the namespace it adds kernels to as one that defines it
    does: the refusal names the library that registered the schemas (its source file,
    which TORCH_LIBRARY compiles in), though the kernels' library is listed first."""
    if shutil.which("strip") is None:
        pytest.skip("needs binutils' strip")
    kernels = tmp_path_factory.mktemp("kernels") / "checked_ops_cuda.so"  # sorts first
    shutil.copy(built["checked_ops_cuda"], kernels)
    subprocess.run(["strip", "--strip-all", str(kernels)], check=True)
    assert str(kernels) < str(built["checked_ops"])
    flags = [kernels, built["checked_ops"], built["checked_ops_v2"]]
    flags = [part for path in flags for part in ("--load-library", str(path))]
    error = _one_line_error(
        _run("-m", "bladesmith", "optimize", str(built["model"]), *flags, *SIZE, cwd=tmp_path)
    )
    assert f"which {built['checked_ops']} defines too" in error


def test_a_stripped_library_whose_trial_load_dies_is_refused_in_one_line(
    built, tmp_path, monkeypatch
):
    """What the child process that tries a stripped library says when it dies of
    something else than a second definition: loading it here could end this process."""
    if shutil.which("strip") is None:
        pytest.skip("needs binutils' strip")
    stripped = Path(shutil.copy(built["crashing_ops"], tmp_path / "stripped_crashing_ops.so"))
    subprocess.run(["strip", "--strip-all", str(stripped)], check=True)
    monkeypatch.setenv("CRASH_ON_LOAD", "1")
    flags = ["--load-library", str(built["checked_ops"]), "--load-library", str(stripped)]
    error = _one_line_error(
        _run("-m", "bladesmith", "optimize", str(built["model"]), *flags, *SIZE, cwd=tmp_path)
    )
    assert f"--load-library {stripped}: loading it in a separate process killed" in error
    assert "signal 6" in error and "check the library" in error


def test_two_builds_of_one_namespace_are_refused_before_the_second_loads(built, tmp_path):
    first, second = str(built["checked_ops"]), str(built["checked_ops_v2"])
    flags = ["--load-library", first, "--load-library", second]
    error = _one_line_error(
        _run("-m", "bladesmith", "optimize", str(built["model"]), *flags, *SIZE, cwd=tmp_path)
    )
    assert f"--load-library {second}: it defines the operator namespace checked_ops" in error
    assert first in error and "load only one of them" in error

    # An artifact's saved copy against another build given on the command line and in
    # Python; the same library again, by another path, is loaded once.
    out = tmp_path / "opt.pt"
    saved = _run(
        "-m", "bladesmith", "optimize", str(built["model"]), "--load-library", first, *SIZE,
        "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    copy = shutil.copy(first, tmp_path / "copy_of_checked_ops.so")
    bench = ["-m", "bladesmith", "bench", str(out), "--trust", "--warmup", "0", "--iters", "1"]
    error = _one_line_error(_run(*bench, "--load-library", second, cwd=tmp_path))
    assert f"{out}: its library {tmp_path}/opt.pt.libs/checked_ops.so" in error
    assert second in error
    same = _run(*bench, "--load-library", first, "--load-library", str(copy), cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    script = f"import torch, bladesmith; torch.ops.load_library({second!r}); "
    loaded = _run("-c", script + f"bladesmith.load({str(out)!r}, trust=True)", cwd=tmp_path)
    assert loaded.returncode == 1 and "terminate called" not in loaded.stderr, loaded.stderr
    assert "BladesmithError" in loaded.stderr and "checked_ops.so: it defines" in loaded.stderr


def test_another_versions_schema_names_both_and_the_models_call(built, tmp_path):
    flags = ["--load-library", str(built["checked_ops_v2"]), *SIZE]
    error = _one_line_error(
        _run("-m", "bladesmith", "optimize", str(built["model"]), *flags, cwd=tmp_path)
    )
    assert "not a TorchScript model" not in error
    assert (
        f"the schema of checked_ops::scale_add in {built['checked_ops_v2']}, "
        "checked_ops::scale_add(Tensor x, Tensor y) -> Tensor, does not take the model's "
        "call `_0 = ops.checked_ops.halve(ops.checked_ops.scale_add(x, x, 2.))` (Expected "
        "at most 2 arguments but found 3 positional arguments)"
    ) in error
    assert "load the version of the library that the model was made with" in error


class CallsTheGpuOnlyOperator(nn.Module):
    def forward(self, x):
        return torch.ops.gpu_only_ops.twice(x)


@pytest.mark.parametrize("form", ["eager", "scripted"])
def test_an_operator_without_a_kernel_for_the_device_says_which_it_has(built, form):
    """TorchScript's message ends with the dispatcher's fallbacks: the line said was
    "PythonDispatcher: registered at ...", with advice on the input size."""
    import bladesmith

    libraries.load(built["gpu_only_ops"])
    model = CallsTheGpuOnlyOperator()
    if form == "scripted":
        model = torch.jit.script(model)
    config = bladesmith.Config(warmup=0, iters=1, progress=False)
    with pytest.raises(BladesmithError) as raised:
        bladesmith.optimize(model, device="cpu", test_data=[torch.rand(2, 3)], config=config)
    assert not isinstance(raised.value, ModelRunError)  # the CLI would blame the input size
    assert str(raised.value) == (
        "gpu_only_ops::twice has no CPU kernel in gpu_only_ops.so (it has: CUDA): register "
        "one (TORCH_LIBRARY_IMPL(gpu_only_ops, CPU, m)), or optimize for a device it has one "
        "for"
    )


def _cli(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_library_of_other_operators_is_named_with_what_it_defines(built, capsys):
    library = built["gpu_only_ops"]
    err = _cli(["optimize", str(built["model"]), "--load-library", str(library), *SIZE], capsys)
    assert "operator checked_ops::scale_add is not loaded" in err
    assert "of the libraries loaded, gpu_only_ops.so defines gpu_only_ops::* only" in err


def test_a_folder_given_as_a_library_names_the_libraries_in_it(built, capsys):
    folder = built["gpu_only_ops"].parent
    err = _cli(["optimize", str(built["model"]), "--load-library", str(folder), *SIZE], capsys)
    assert f"--load-library {folder}: a folder; give a library file in it (gpu_only_ops.so)" in err
    assert "no such file" not in err
