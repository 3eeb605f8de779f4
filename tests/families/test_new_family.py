"""A new family is one module and one registry line: a toy detector family, registered,
is recognised by optimize, adapted, saved, and loaded again in a new process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from toy_family import FAMILY, ToyDetector, ToyPipeline

import bladesmith
from bladesmith import families
from bladesmith.config import Config
from bladesmith.passes.fixed_shape import FixedShape
from bladesmith.verify import compare_detections
from engine_testing import Memoized

HERE = Path(__file__).parent


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", [*families.FAMILIES, FAMILY])


def optimize_toy(model, images):
    return bladesmith.optimize(
        model,
        device="cpu",
        test_data=[(images,)],
        config=Config(warmup=0, iters=1),
        passes=[FixedShape(), Memoized()],
    )


def toy_and_images():
    torch.manual_seed(0)
    model = ToyDetector().eval()
    model.scorer.bias.data.fill_(-0.3)  # some cells pass the threshold, not all
    images = [torch.rand(3, 16, 24) for _ in range(2)]
    return model, images


def test_an_unregistered_family_is_not_recognised():
    model, _ = toy_and_images()
    assert families.family_of(model) is None
    assert "no family" in FixedShape().skip_reason(
        bladesmith.passes.Candidate(model, torch.device("cpu")), None
    )


@pytest.mark.slow
def test_optimize_adapts_a_registered_family_saves_it_and_a_new_process_loads_it(
    registered, tmp_path
):
    model, images = toy_and_images()
    assert families.family_of(model) is FAMILY
    expected = model(images)
    assert {len(d["scores"]) for d in expected} != {8}, "some slots must be padding"
    optimized, spec, report = optimize_toy(model, images)
    assert spec.passes == ("fixed_shape", "memoized"), report.optimizations
    assert (spec.family, spec.output) == ("toy", "detections")
    assert isinstance(optimized.candidate.module, ToyPipeline)
    got = optimized(images)
    assert compare_detections(expected, got).passed
    assert [len(d["scores"]) for d in got] == [len(d["scores"]) for d in expected]

    path = bladesmith.save(optimized, tmp_path / "toy.pt")
    family, loaded_out = loaded_in_a_new_process(path, images, tmp_path)
    assert family == "toy"
    assert compare_detections(expected, loaded_out).passed


def loaded_in_a_new_process(path, images, tmp_path):
    """(the family, the outputs on ``images``) of the artifact at ``path`` loaded in a new
    process that registers the toy family."""
    torch.save(images, tmp_path / "images.pt")
    code = (
        "import sys, torch; import bladesmith; from bladesmith import families; "
        "import toy_family; families.FAMILIES.append(toy_family.FAMILY); "
        f"loaded = bladesmith.load({str(path)!r}); "
        f"images = torch.load({str(tmp_path / 'images.pt')!r}); "
        f"torch.save((loaded.spec.family, loaded(images)), {str(tmp_path / 'out.pt')!r})"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return torch.load(tmp_path / "out.pt")


def test_a_detector_whose_module_does_not_trace_saves_through_its_pipeline(registered, tmp_path):
    # No pass: the result is the toy module itself, whose list of detections (their
    # number follows the data) TorchScript cannot trace.
    model, images = toy_and_images()
    expected = model(images)
    optimized, spec, report = bladesmith.optimize(
        model, device="cpu", test_data=[(images,)], config=Config(warmup=0, iters=1), passes=[]
    )
    assert spec.passes == () and optimized.family is None
    assert ".pt" in spec.save_formats and ".pt" not in spec.refused_formats, spec
    assert ".pt2" in spec.untried_formats
    assert "through the toy fixed-shape pipeline" in report.diagnosis["message"]
    path = bladesmith.save(optimized, tmp_path / "toy.pt")
    family, loaded_out = loaded_in_a_new_process(path, images, tmp_path)
    assert family == "toy"
    assert compare_detections(expected, loaded_out, iou_threshold=0.999, min_f1=1.0).passed


def test_loading_an_artifact_of_an_unknown_family_says_what_to_do(registered, tmp_path):
    model, images = toy_and_images()
    optimized, _, _ = optimize_toy(model, images)
    path = bladesmith.save(optimized, tmp_path / "toy.pt")
    families.FAMILIES.remove(FAMILY)
    with pytest.raises(bladesmith.errors.BladesmithError, match="no model family named 'toy'"):
        bladesmith.load(path)
