"""The built-in models: each built by the family it names, and ``--weights`` loaded the
same way for every family (checkpoints unwrapped, a wrong file one line)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from bladesmith.cli import main
from bladesmith.errors import BladesmithError
from bladesmith.families import family_of
from bladesmith.models.catalog import CATALOG, build

SIZE = (64, 96)
CLASSES = 2
# name prefix -> the family that must recognise the model
FAMILIES = {
    "retinanet_": "retinanet",
    "fcos_": "fcos",
    "ssd": "ssd",
    "fasterrcnn_": "faster_rcnn",
    "maskrcnn_": "mask_rcnn",
}
# The smallest built-in model of each family, and how its weights file wraps the state
# dict (as training scripts save it; None: the state dict itself).
SMALLEST = {
    "torchvision:retinanet_resnet18_fpn": None,
    "torchvision:fcos_resnet50_fpn": "state_dict",
    "torchvision:ssdlite320_mobilenet_v3_large": "model",
    "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn": "state_dict",
    "torchvision:maskrcnn_resnet50_fpn": "model",
}


def _family_expected(name: str) -> str:
    builder = name.removeprefix("torchvision:")
    return next(family for prefix, family in FAMILIES.items() if builder.startswith(prefix))


@pytest.mark.parametrize("name", CATALOG)
def test_every_builtin_model_is_built_by_the_family_it_names(name):
    model = CATALOG[name].build(SIZE, CLASSES, realistic_load=False)
    assert not model.training
    assert family_of(model).name == _family_expected(name)


def test_each_family_has_a_builtin_model_in_the_weights_tests():
    assert {_family_expected(name) for name in CATALOG} == {
        _family_expected(name) for name in SMALLEST
    }


@pytest.mark.parametrize("name", SMALLEST)
def test_weights_of_every_family_are_unwrapped_and_loaded(name, tmp_path):
    """Random weights (another seed than the built-in's) saved as a training script
    would; the built-in model built with them holds exactly them."""
    state = CATALOG[name].build(SIZE, CLASSES, realistic_load=False, seed=1).state_dict()
    wrapper = SMALLEST[name]
    path = tmp_path / "weights.pth"
    torch.save(state if wrapper is None else {wrapper: state, "epoch": 3}, path)
    loaded = build(name, SIZE, weights=path, num_classes=CLASSES).state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("name", SMALLEST)
def test_a_wrong_weights_file_is_one_line_naming_it_and_the_flag(name, tmp_path):
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": nn.Linear(2, 2).state_dict(), "epoch": 3}, path)
    with pytest.raises(BladesmithError) as raised:
        build(name, SIZE, weights=path, num_classes=CLASSES)
    message = str(raised.value)
    assert "\n" not in message and f"--weights {str(path)!r} (under 'model')" in message
    assert "a state dict for another model" in message and len(message) < 600, message


@pytest.mark.parametrize("content", ["random bytes", "a tensor"])
def test_the_command_line_says_a_wrong_weights_file_in_one_line(content, tmp_path, capsys):
    path = tmp_path / "weights.pt"
    if content == "random bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    else:
        torch.save(torch.zeros(3), path)
    code = main(
        ["optimize", "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", "--weights", str(path)]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "--weights" in err and str(path) in err


def test_the_families_and_what_they_use_import_no_layer_above_them():
    """The built-in models are built on the families: neither the families nor the
    modules below them (images, convs) import models/, the passes or the engine."""
    import ast
    from pathlib import Path

    import bladesmith

    root = Path(bladesmith.__file__).parent
    above = ("bladesmith.models", "bladesmith.passes", "bladesmith.engine", "bladesmith.cli")
    for path in [*sorted((root / "families").glob("*.py")), root / "images.py", root / "convs.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(above), f"{path.name} imports {name}"
