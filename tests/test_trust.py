"""The trust model (docs/security.md): what loads from anyone, what needs ``--trust``
(Python: ``trust=True``), refused in one line naming the file and the flag before
anything runs, and announced on stderr when trusted. Each row of the table in
docs/security.md names its test here (or in the file it says)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import bladesmith
from bladesmith.engine import load_model_file
from bladesmith.errors import BladesmithError
from bladesmith.ops import libraries
from bladesmith.runtimes.torchscript import quiet_torchscript
from bladesmith.trust import UntrustedFileError, require
from test_artifact import optimized_net

ORIGINAL = b"untouched bytes"


class WritesAFile(nn.Module):
    """TorchScript that maps ``path`` shared and writes into it when called: no pickle,
    no library, only TorchScript."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def forward(self, x):
        mapped = torch.from_file(self.path, shared=True, size=4, dtype=torch.uint8)
        mapped.fill_(65)
        return x + mapped[:1].float() * 0


class WritesAFileAsItLoads(nn.Module):
    """TorchScript whose ``__setstate__``, which torch.jit.load runs as it reads the
    file, writes into ``path``."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    @torch.jit.export
    def __getstate__(self):
        return (self.path, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]):
        self.path = state[0]
        mapped = torch.from_file(self.path, shared=True, size=4, dtype=torch.uint8)
        mapped.fill_(66)
        self.training = state[1] and bool(mapped[0] == 66)

    def forward(self, x):
        return x + 1


def _scripted(module: nn.Module, path: Path) -> Path:
    with quiet_torchscript():
        torch.jit.save(torch.jit.script(module), str(path))
    return path


@pytest.fixture
def target(tmp_path) -> Path:
    path = tmp_path / "target.bin"
    path.write_bytes(ORIGINAL)
    return path


def _refused(call, path) -> str:
    with pytest.raises(UntrustedFileError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "--trust" in message
    return message


def test_torchscript_that_maps_a_file_is_refused_and_the_file_unchanged(tmp_path, target):
    """Row: a .pt whose graph calls an operator outside the allowlist."""
    path = _scripted(WritesAFile(str(target)), tmp_path / "writes.pt")
    message = _refused(lambda: load_model_file(path), path)
    assert "aten::from_file" in message
    assert target.read_bytes() == ORIGINAL
    # What the refusal prevents: trusted, it loads, and a call writes the file.
    load_model_file(path, trust=True)(torch.zeros(1))
    assert target.read_bytes() != ORIGINAL


def test_a_setstate_is_refused_before_torch_jit_load_runs_it(tmp_path, target):
    """Row: a .pt with a TorchScript __setstate__ (torch.jit.load runs it)."""
    path = _scripted(WritesAFileAsItLoads(str(target)), tmp_path / "state.pt")
    assert "__setstate__" in _refused(lambda: load_model_file(path), path)
    assert target.read_bytes() == ORIGINAL
    load_model_file(path, trust=True)  # reading it is enough
    assert target.read_bytes() != ORIGINAL


def test_the_command_line_refuses_it_in_one_line(tmp_path, target):
    path = _scripted(WritesAFile(str(target)), tmp_path / "writes.pt")
    result = subprocess.run(
        [sys.executable, "-m", "bladesmith", "optimize", str(path), "--input-size", "8x8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--trust" in lines[0] and str(path) in lines[0]
    assert target.read_bytes() == ORIGINAL


@pytest.mark.parametrize(
    "name, how",
    [
        ("resnet18", "script"),
        ("mobilenet_v3_small", "trace"),
        ("squeezenet1_0", "freeze"),
        ("shufflenet_v2_x0_5", "script"),
        ("regnet_y_400mf", "trace"),
        ("efficientnet_b0", "freeze"),
    ],
)
def test_torchvision_models_load_without_trust(name, how, tmp_path):
    """Row: a .pt inside the allowlist (scripted, traced, frozen)."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    x = torch.rand(1, 3, 64, 64)
    with quiet_torchscript(), torch.no_grad():
        if how == "script":
            module = torch.jit.script(model)
        else:
            module = torch.jit.trace(model, (x,), check_trace=False)
            if how == "freeze":
                module = torch.jit.freeze(module)
        torch.jit.save(module, str(tmp_path / "m.pt"))
    loaded = load_model_file(tmp_path / "m.pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_bladesmiths_own_torchscript_artifact_loads_without_trust(tmp_path, capsys):
    """Row: bladesmith's own .pt (frozen trace; its detector's, with bladesmith's
    operators: tests/test_artifact.py::test_torchscript_detector_round_trip_returns_detections)."""
    optimized, _, x = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    torch.testing.assert_close(bladesmith.load(path)(x), optimized(x))
    assert "trusting" not in capsys.readouterr().err


def _package(tmp_path: Path) -> Path:
    """An AOTInductor package's layout with bladesmith's metadata (no real model: the
    gate comes before torch's loader)."""
    import zipfile

    metadata = json.dumps({"bladesmith": json.dumps({"device": "cpu", "libraries": []})})
    path = tmp_path / "package.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("package/data/aotinductor/model/m_metadata.json", metadata)
        archive.writestr("package/data/aotinductor/model/m.so", b"\x7fELF")
    return path


def test_an_aotinductor_package_needs_trust(tmp_path):
    """Row: a .pt2 AOTInductor package (bladesmith.load, bench, serve)."""
    path = _package(tmp_path)
    assert "compiled AOTInductor code" in _refused(lambda: bladesmith.load(path), path)


def test_a_recorded_library_needs_trust_even_with_its_sha256(tmp_path):
    """Row: an artifact with ARTIFACT.libs/*.so recorded in its own metadata."""
    import hashlib

    artifact = tmp_path / "model.pt"
    artifact.write_bytes(b"model")
    folder = libraries.folder_beside(artifact)
    folder.mkdir()
    (folder / "ops.so").write_bytes(b"\x7fELF ops")
    digest = hashlib.sha256(b"\x7fELF ops").hexdigest()
    entries = [{"file": "ops.so", "operators": ["plantedops::run"], "sha256": digest}]
    (folder / "libraries.json").write_text(json.dumps(entries))
    loaded = set(torch.ops.loaded_libraries)
    message = _refused(lambda: libraries.restore(artifact, entries), artifact)
    assert "model.pt.libs/ops.so" in message
    assert set(torch.ops.loaded_libraries) == loaded


def test_trusted_it_says_what_runs_on_stderr_first(tmp_path, capsys):
    require(tmp_path / "x.pt2", "the compiled AOTInductor code", True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "x.pt2") in err[0] and "compiled" in err[0]


def test_metadata_naming_an_unregistered_family_is_refused(tmp_path):
    """Row: artifact metadata names a family (only registered ones are used)."""
    optimized, _, _ = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.onnx")
    import onnx

    model = onnx.load(str(path))
    for entry in model.metadata_props:
        if entry.key == "bladesmith":
            info = json.loads(entry.value)
            info["family"] = "os"
            entry.value = json.dumps(info)
    onnx.save(model, str(path))
    with pytest.raises(BladesmithError) as refused:
        bladesmith.load(path)
    assert "\n" not in str(refused.value) and "no model family named 'os'" in str(refused.value)


def test_trust_on_the_command_line_says_what_runs_before_it_runs(tmp_path, target):
    path = _scripted(WritesAFile(str(target)), tmp_path / "writes.pt")
    command = ["export", "onnx", str(path), str(tmp_path / "o.onnx"), "--input-size", "8x8"]
    result = subprocess.run(
        [sys.executable, "-m", "bladesmith", *command, "--trust"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    first = result.stderr.splitlines()[0]
    assert first.startswith("bladesmith: trusting") and str(path) in first, result.stderr
    assert "aten::from_file" in first
    assert "bladesmith.load" not in result.stderr
