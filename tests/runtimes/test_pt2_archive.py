"""A crafted .pt2 whose pickle would run code (here: create a marker file) never runs it:
``optimize``'s model loader refuses it in one line unless trusted, and
``bladesmith.load`` reads a package without torch's Python reader at all."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith.engine import load_model_file
from bladesmith.errors import BladesmithError
from bladesmith.runtimes import pt2_archive


class Touch:
    """Unpickled, it creates ``path``: any code could run there instead."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _program(path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).eval()
    torch.export.save(torch.export.export(model, (torch.rand(1, 3),)), str(path))
    return path


def _rewritten(source: Path, target: Path, replace: dict[str, bytes]) -> Path:
    """``source`` with the members named in ``replace`` (without the root folder)
    replaced or added."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        root = old.namelist()[0].split("/")[0]
        for info in old.infolist():
            inner = info.filename.partition("/")[2]
            new.writestr(info, replace.pop(inner, old.read(info)))
        for inner, data in replace.items():
            new.writestr(f"{root}/{inner}", data)
    return target


def _pickled(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.fixture
def crafted(tmp_path) -> tuple[Path, Path]:
    """A torch.export program whose sample inputs unpickle into creating a marker."""
    marker = tmp_path / "marker"
    program = _program(tmp_path / "program.pt2")
    payload = {"data/sample_inputs/model.pt": _pickled(((Touch(marker),), {}))}
    return _rewritten(program, tmp_path / "crafted.pt2", payload), marker


def test_a_plain_program_has_no_unsafe_pickle_and_loads(tmp_path):
    path = _program(tmp_path / "plain.pt2")
    assert pt2_archive.unsafe_pickle(path) is None
    assert load_model_file(path)(torch.rand(1, 3)).shape == (1, 2)


def test_a_crafted_pickle_is_refused_in_one_line_and_never_runs(crafted):
    path, marker = crafted
    assert pt2_archive.unsafe_pickle(path).startswith("data/sample_inputs/model.pt")
    with pytest.raises(BladesmithError) as refused:
        load_model_file(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "--trust" in message
    assert not marker.exists()


def test_trust_reads_it_as_torch_does(crafted):
    """The pickle is live: what the refusal prevents."""
    path, marker = crafted
    with pytest.raises(Exception):  # noqa: B017  (torch's own, whatever it is)
        load_model_file(path, trust=True)
    assert marker.exists()


def test_optimize_and_export_refuse_it_on_the_command_line(crafted, tmp_path):
    path, marker = crafted
    for command in (
        ["optimize", str(path)],
        ["export", "onnx", str(path), str(tmp_path / "o.onnx")],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "bladesmith", *command, "--input-size", "8x8"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1, result.stderr
        assert "--trust" in lines[0] and not marker.exists()


def test_load_never_unpickles_a_package(crafted, tmp_path):
    """bladesmith.load of a package carrying the crafted program and bladesmith's
    metadata: torch's C++ loader finds no compiled model, the pickle is never read."""
    path, marker = crafted
    metadata = json.dumps({"bladesmith": json.dumps({"device": "cpu", "libraries": []})})
    package = _rewritten(
        path, tmp_path / "package.pt2", {"data/aotinductor/model/m_metadata.json": metadata}
    )
    with pytest.raises(BladesmithError) as refused:
        bladesmith.load(package)
    assert "\n" not in str(refused.value) and str(package) in str(refused.value)
    assert not marker.exists()
