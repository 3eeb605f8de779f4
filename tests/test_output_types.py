"""A model returning a dataclass, a NamedTuple or a ``ModelOutput`` gets the same type
back from ``optimize``, from ``load`` and from a new process that loads the artifact;
where the type cannot be found without running the artifact's code, plain containers and
one warning naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import bladesmith
from bladesmith.config import Config
from bladesmith.typed_outputs import find, plain
from typed_output_models import ModelOutput, Net, Pair, Prediction

QUICK = Config(warmup=0, iters=1)
TYPES = [Prediction, Pair, ModelOutput]
X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))

# Loads each artifact, runs it, prints its output's type and saves its plain values.
_CHILD = """
import importlib, sys, torch, bladesmith
from bladesmith.typed_outputs import plain
module_name, inputs, *paths = sys.argv[1:]
if module_name:  # the user's code that defines the type, imported as a deployment would
    importlib.import_module(module_name)
x = torch.load(inputs, weights_only=True)
for path in paths:
    out = bladesmith.load(path, trust=path.endswith(".pt2"))(x)  # compiled code: trusted
    print(f"{type(out).__module__}:{type(out).__qualname__}")
    torch.save(plain(out), path + ".out")
"""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _assert_same(got, expected, tolerance=None) -> None:
    """Same type and entries; values equal, or within ``tolerance`` (a spec's: a kept
    precision pass moves them as far as the gate allowed)."""
    assert type(got) is type(expected)
    if isinstance(expected, dict):
        assert list(got) == list(expected)  # a ModelOutput's entries, in order
    within = {"rtol": tolerance["rtol"], "atol": tolerance["atol"]} if tolerance else {}
    torch.testing.assert_close(plain(got), plain(expected), **within)


def _optimized(output_type, passes=()):
    model = Net(output_type)
    optimized, spec, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(X,)], config=QUICK, passes=passes
    )
    return model, optimized, spec


def _run_in_new_process(paths, tmp_path, import_module: str = ""):
    inputs = tmp_path / "x.pt"
    torch.save(X, inputs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, import_module, str(inputs), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [torch.load(f"{path}.out", weights_only=True) for path in paths]
    return done.stdout.split(), outputs, done.stderr


@pytest.mark.parametrize("output_type", TYPES, ids=lambda t: t.__name__)
def test_optimize_returns_the_models_output_type(output_type):
    """With every pass that runs on the CPU: whatever it keeps returns the type."""
    model, optimized, spec = _optimized(output_type, passes=None)
    with torch.no_grad():
        expected = model(X)
    _assert_same(optimized(X), expected, spec.tolerance)
    assert spec.output_types["type"] == _name(output_type)


@pytest.mark.parametrize("output_type", TYPES, ids=lambda t: t.__name__)
def test_each_saved_format_gives_the_type_back_here_and_in_a_new_process(output_type, tmp_path):
    model, optimized, spec = _optimized(output_type)
    with torch.no_grad():
        expected = model(X)
    paths = []
    for suffix in (".pt", ".onnx"):
        assert suffix in spec.save_formats, spec.refused_formats
        paths.append(bladesmith.save(optimized, tmp_path / f"net{suffix}"))
        _assert_same(bladesmith.load(paths[-1])(X), expected)  # a TorchScript, an ONNX runner
    names, outputs, _ = _run_in_new_process(paths, tmp_path, output_type.__module__)
    assert names == [_name(output_type)] * len(paths)
    for got in outputs:
        torch.testing.assert_close(got, plain(expected))


@pytest.mark.slow
def test_a_pt2_gives_the_type_back_in_a_new_process(tmp_path):
    model, optimized, _ = _optimized(Prediction)
    path = bladesmith.save(optimized, tmp_path / "net.pt2")
    names, outputs, _ = _run_in_new_process([path], tmp_path, Prediction.__module__)
    assert names == [_name(Prediction)]
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], plain(model(X)))


def test_a_type_that_cannot_be_found_comes_back_plain_with_one_warning(tmp_path):
    """A new process that has not imported the module defining the type (not an installed
    package's: it is not imported for the file's asking) gets dicts and tuples."""
    paths = []
    for output_type in (Prediction, Pair):
        _, optimized, _ = _optimized(output_type)
        paths.append(bladesmith.save(optimized, tmp_path / f"{output_type.__name__}.pt"))
    names, outputs, stderr = _run_in_new_process(paths, tmp_path)
    assert names == ["builtins:dict", "builtins:tuple"]
    assert stderr.count("typed_output_models:Prediction not found") == 1
    assert stderr.count("typed_output_models:Pair not found") == 1
    with torch.no_grad():
        for got, output_type in zip(outputs, (Prediction, Pair)):
            torch.testing.assert_close(got, plain(Net(output_type)(X)))


def test_a_recorded_name_never_imports_a_module_outside_the_allowlist(tmp_path, monkeypatch):
    """A file names any module it likes: one beside it on the path, or of an installed
    package outside typed_outputs.IMPORTABLE, is not imported (its code would run), and
    what is found is called only if it is a class of the kind. (docs/security.md, trust
    model: artifact metadata)"""
    (tmp_path / "planted.py").write_text(
        "import pathlib, dataclasses\n"
        f"pathlib.Path({str(tmp_path / 'ran')!r}).touch()\n"
        "@dataclasses.dataclass\nclass Out:\n    x: int\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find("planted:Out", "dataclass") is None
    assert not (tmp_path / "ran").exists() and "planted" not in sys.modules
    assert find("os:system", "dataclass") is None  # not a class
    assert find("collections:OrderedDict", "namedtuple") is None  # not of the kind
    assert find(_name(Pair), "namedtuple") is Pair  # imported: the user's code
    # An installed package's module, not yet imported: left alone.
    probe = (
        "import sys; from bladesmith.typed_outputs import find; "
        "assert find('colorama.ansitowin32:AnsiToWin32', 'dataclass') is None; "
        "assert 'colorama' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


def test_transformers_model_output_keeps_its_type(tmp_path):
    outputs = pytest.importorskip("transformers.modeling_outputs")
    cls = outputs.SequenceClassifierOutput

    def as_output(logits, hidden):
        return cls(logits=logits, hidden_states=(hidden,))

    model, optimized, _ = _optimized(as_output)
    with torch.no_grad():
        expected = model(X)
    _assert_same(optimized(X), expected)
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    # transformers is an installed package: a new process imports its module by name.
    names, got, _ = _run_in_new_process([path], tmp_path)
    assert names == [_name(cls)]
    torch.testing.assert_close(got[0], plain(expected))
