"""A crafted .pt2 whose pickle would run code (here: create a marker file) never runs it:
``optimize``'s model loader reads a program without pickle and refuses, in one line
unless trusted, any archive holding more than the entries it expects (the tricks that
once passed: a models/ entry not ending in .json, a NUL in a name, an absolute payload
path), and ``bladesmith.load`` reads a package without torch's Python reader at all."""

from __future__ import annotations

import contextlib
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
from bladesmith.trust import UntrustedFileError


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


def _with_nul(path: Path, placeholder: str, name: str) -> Path:
    """``path`` with the entry ``placeholder`` renamed ``name`` (same length, a NUL in
    it), which Python's zipfile cannot write: its bytes patched in both headers."""
    assert len(placeholder) == len(name) and "\0" in name
    path.write_bytes(path.read_bytes().replace(placeholder.encode(), name.encode()))
    return path


def _config(source: Path, name: str) -> dict:
    with zipfile.ZipFile(source) as archive:
        root = archive.namelist()[0].split("/")[0]
        return json.loads(archive.read(f"{root}/{name}"))


@pytest.fixture
def crafted(tmp_path) -> tuple[Path, Path]:
    """A torch.export program one of whose weights is a pickle that creates a marker."""
    marker = tmp_path / "marker"
    program = _program(tmp_path / "program.pt2")
    config = _config(program, "data/weights/model_weights_config.json")
    entry = config["config"]["0.bias"]
    entry.update(use_pickle=True, path_name="weight_1")
    payload = {
        "data/weights/model_weights_config.json": json.dumps(config).encode(),
        "data/weights/weight_1": _pickled(Touch(marker)),
    }
    return _rewritten(program, tmp_path / "crafted.pt2", payload), marker


def _trick(kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """A program carrying a pickle that creates a marker, in one of the three ways that
    once got it past the check: an entry of models/ whose name does not end in .json, a
    NUL in an entry's name, an absolute payload path."""
    marker = tmp_path / "marker"
    program = _program(tmp_path / "program.pt2")
    evil = _pickled(((Touch(marker),), {}))
    target = tmp_path / f"{kind}.pt2"
    if kind == "models_not_json":
        # torch reads every entry of models/ as a program, "evil_json" as "evil"
        payload = {
            "models/evil_json": _config(program, "models/model.json"),
            "data/sample_inputs/evil.pt": evil,
            "data/weights/evil_weights_config.json": _config(
                program, "data/weights/model_weights_config.json"
            ),
            "data/constants/evil_constants_config.json": b'{"config": {}}',
        }
        payload = {
            k: v if isinstance(v, bytes) else json.dumps(v).encode() for k, v in payload.items()
        }
        return _rewritten(program, target, payload), marker
    if kind == "nul_in_name":
        placeholder = "data/weights/weight_9Xhidden"
        _rewritten(program, target, {placeholder: evil})
        return _with_nul(target, placeholder, "data/weights/weight_9\0hidden"), marker
    config = _config(program, "data/weights/model_weights_config.json")
    config["config"]["0.bias"].update(use_pickle=True, path_name=str(tmp_path / "evil.pt"))
    (tmp_path / "evil.pt").write_bytes(_pickled(Touch(marker)))
    payload = {"data/weights/model_weights_config.json": json.dumps(config).encode()}
    return _rewritten(program, target, payload), marker


TRICKS = ["models_not_json", "nul_in_name", "absolute_path_name"]


def test_a_plain_program_loads_without_trust(tmp_path):
    path = _program(tmp_path / "plain.pt2")
    assert load_model_file(path)(torch.rand(1, 3)).shape == (1, 2)


def test_a_program_with_dynamic_shapes_loads_without_trust(tmp_path):
    """Its shape expressions (sympy's srepr: "Mul(Integer(2), Symbol('s39', ...))") are
    arithmetic: read as torch reads them."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(0, 1)).eval()
    batch, height = torch.export.Dim("batch", max=64), torch.export.Dim("height", max=32)
    dims = ({0: batch, 2: 2 * height},)
    program = torch.export.export(model, (torch.rand(2, 3, 8, 8),), dynamic_shapes=dims)
    torch.export.save(program, str(tmp_path / "dynamic.pt2"))
    x = torch.rand(3, 3, 12, 8)
    torch.testing.assert_close(load_model_file(tmp_path / "dynamic.pt2")(x), model(x))


def test_its_sample_inputs_are_never_unpickled(tmp_path):
    """torch's reader unpickles the sample inputs (weights_only=False when the safe
    unpickler refuses them); the pickle-free reader never reads them."""
    marker = tmp_path / "marker"
    program = _program(tmp_path / "program.pt2")
    payload = {"data/sample_inputs/model.pt": _pickled(((Touch(marker),), {}))}
    path = _rewritten(program, tmp_path / "sample.pt2", payload)
    assert load_model_file(path)(torch.rand(1, 3)).shape == (1, 2)
    assert not marker.exists()


def test_a_pickled_weight_is_refused_in_one_line_and_never_runs(crafted):
    path, marker = crafted
    with pytest.raises(UntrustedFileError) as refused:
        load_model_file(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "--trust" in message
    assert "weight_1" in message and not marker.exists()


@pytest.mark.parametrize("kind", TRICKS)
def test_each_archive_trick_is_refused_and_never_runs(kind, tmp_path):
    """docs/security.md, trust model: a .pt2 torch.export program."""
    path, marker = _trick(kind, tmp_path)
    with pytest.raises(UntrustedFileError) as refused:
        load_model_file(path)
    assert "\n" not in str(refused.value) and "--trust" in str(refused.value)
    assert not marker.exists()


def test_the_models_trick_is_live_under_trust(tmp_path):
    """What the refusal prevents: torch's reader runs the pickle."""
    path, marker = _trick("models_not_json", tmp_path)
    with contextlib.suppress(Exception):
        load_model_file(path, trust=True)
    assert marker.exists()


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('pathlib').Path({marker!r}).touch()",
        "eval(chr(95) + chr(95))",  # no quotes: a name outside sympy's and torch's
        "Symbol('s1').__class__",
    ],
)
def test_a_shape_expression_that_is_python_is_refused(expression, tmp_path):
    """torch's reader hands a program's shape expressions to sympy.sympify (eval)."""
    program = _program(tmp_path / "program.pt2")
    model = _config(program, "models/model.json")
    marker = tmp_path / "marker"
    node_meta = {"expr_str": expression.format(marker=str(marker)), "hint": None}
    model["graph_module"]["graph"]["sym_int_values"] = {"s9": {"as_expr": node_meta}}
    payload = {"models/model.json": json.dumps(model).encode()}
    path = _rewritten(program, tmp_path / "expr.pt2", payload)
    with pytest.raises(UntrustedFileError) as refused:
        load_model_file(path)
    assert "shape expression" in str(refused.value) and not marker.exists()


def test_trust_reads_it_as_torch_does(crafted):
    """The pickle is live: what the refusal prevents."""
    path, marker = crafted
    with contextlib.suppress(Exception):  # torch's own, whatever it is
        load_model_file(path, trust=True)
    assert marker.exists()


@pytest.mark.parametrize("kind", ["crafted", *TRICKS])
def test_optimize_and_export_refuse_it_on_the_command_line(kind, crafted, tmp_path):
    path, marker = crafted if kind == "crafted" else _trick(kind, tmp_path)
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
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert "--trust" in lines[0] and str(path) in lines[0] and not marker.exists()


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


def test_a_package_given_as_a_model_says_how_to_run_it(crafted, tmp_path):
    """An AOTInductor package is no program to optimize, trusted or not: the line says
    what runs it, on the command line first."""
    path, _ = crafted
    metadata = json.dumps({"bladesmith": "{}"})
    package = _rewritten(
        path, tmp_path / "package.pt2", {"data/aotinductor/model/m_metadata.json": metadata}
    )
    for trust in (False, True):
        with pytest.raises(BladesmithError) as refused:
            load_model_file(package, trust=trust)
        assert "bladesmith bench or serve" in str(refused.value)
