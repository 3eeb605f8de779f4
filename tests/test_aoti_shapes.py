"""A .pt2 of test data of several shapes: one AOTInductor model per input signature, each
run at its own shapes in a new process; other shapes refused in one line; a .pt2 of one
model, written before there could be several, still loads."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.errors import BladesmithError
from engine_testing import Flags
from test_reload import reload_in_new_process

QUICK = Config(warmup=0, iters=1)
# Every test builds an AOTInductor package (a C++ compile for each model).
pytestmark = pytest.mark.slow


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


@pytest.fixture(scope="module")
def two_batches(tmp_path_factory):
    """A net optimized on batches 1 and 4 (batch 1 twice: one signature), saved as .pt2
    (save loads it in a new process and checks it at both), and the steps save showed."""
    from bladesmith.progress import Progress

    one, four = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 8, 8)
    optimized, spec, _ = bladesmith.optimize(
        small_net(), device="cpu", test_data=[(one,), (four,), (one * 2,)], config=QUICK, passes=[]
    )
    steps = []
    with pytest.MonkeyPatch.context() as patch:
        shown = Progress.step
        patch.setattr(Progress, "step", lambda self, text: steps.append(text) or shown(self, text))
        path = bladesmith.save(optimized, tmp_path_factory.mktemp("pt2") / "net.pt2")
    return optimized, spec, path, (one, four), steps


def test_a_pt2_runs_every_batch_of_the_test_data_in_a_new_process(two_batches, tmp_path):
    optimized, spec, path, batches, _ = two_batches
    assert ".pt2" in spec.untried_formats  # offered: save built it and checked both batches
    rtol, atol = spec.tolerance["rtol"], spec.tolerance["atol"]
    for x in batches:
        with torch.no_grad():
            expected = optimized(x)
        printed = reload_in_new_process(path, (x,), expected, tmp_path, rtol=rtol, atol=atol)
        assert printed.startswith("cpu ")


def test_a_pt2_compiles_one_model_per_signature_and_shows_each(two_batches):
    _, _, path, _, steps = two_batches
    assert steps == [
        "saving net.pt2: AOTInductor compiling for [1, 3, 8, 8] float32 (1 of 2)",
        "saving net.pt2: AOTInductor compiling for [4, 3, 8, 8] float32 (2 of 2)",
    ]
    # torch's own loader gets the first signature's, which the metadata names with the rest
    metadata = json.loads(torch._inductor.aoti_load_package(str(path)).get_metadata()["bladesmith"])
    held = {"dtypes": ["float32"], "constants": []}
    assert metadata["models"] == [
        {"name": "model", "shapes": [[1, 3, 8, 8]], **held},
        {"name": "model_1", "shapes": [[4, 3, 8, 8]], **held},
    ]


def test_a_pt2_refuses_a_shape_it_was_not_compiled_for_in_one_line(two_batches):
    _, _, path, (one, four), _ = two_batches
    loaded = bladesmith.load(path, trust=True)
    assert loaded.batch_fixed
    for other in (torch.cat([one, one]), four[..., :7, :7], four.double()):
        with pytest.raises(BladesmithError) as refused:
            loaded(other)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(str(path)), message
        assert (
            "it runs [1, 3, 8, 8] float32 or [4, 3, 8, 8] float32 only (AOTInductor "
            "compiled one model for each of these shapes)"
        ) in message


def test_a_pt2_loads_each_model_by_name_where_torchs_package_reader_refuses_it(
    two_batches, monkeypatch
):
    """A torch without the reader that reads every model at once (or a package it
    refuses): each model is read by torch's public loader, by name, when first called."""
    from torch.export.pt2_archive import _package

    def refuses(path, **_):
        raise RuntimeError("an outdated package")

    monkeypatch.setattr(_package, "load_pt2", refuses)
    optimized, _, path, batches, _ = two_batches
    loaded = bladesmith.load(path, trust=True)
    for x in batches:
        torch.testing.assert_close(loaded(x), optimized(x), rtol=1e-4, atol=1e-5)


def test_save_checks_a_pt2_at_every_signature(two_batches, monkeypatch):
    from bladesmith import fresh_load
    from bladesmith.fresh_load import reload_problem

    optimized, _, path, batches, _ = two_batches
    right = [optimized(x) for x in batches]
    monkeypatch.setattr(fresh_load, "run_saved_each", lambda path, calls: (right, None))
    assert reload_problem(optimized, path) is None
    moved = [right[0], right[1] + 1]  # the second model answers otherwise
    monkeypatch.setattr(fresh_load, "run_saved_each", lambda path, calls: (moved, None))
    assert reload_problem(optimized, path).startswith(
        "loaded back, its outputs at [4, 3, 8, 8] float32 differ"
    )


def test_a_pt2_of_one_model_written_the_old_way_still_loads(tmp_path):
    """As bladesmith wrote every .pt2 before it held a model per signature: one model,
    compiled by aoti_compile_and_package, its metadata without "models"."""
    from bladesmith.artifact import _metadata
    from bladesmith.runtimes.formats import METADATA_KEY

    x = torch.randn(2, 3, 8, 8)
    optimized, _, _ = bladesmith.optimize(
        small_net(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    inputs = {"free_batch": False, "why": "AOTInductor compiled it for these shapes"}
    metadata = {**_metadata(optimized), "libraries": [], "inputs": inputs}
    path = tmp_path / "old.pt2"
    torch._inductor.aoti_compile_and_package(
        torch.export.export(optimized.candidate.module, (x,), strict=False),
        package_path=str(path),
        inductor_configs={"aot_inductor.metadata": {METADATA_KEY: json.dumps(metadata)}},
    )
    loaded = bladesmith.load(path, trust=True)
    torch.testing.assert_close(loaded(x), optimized(x), rtol=1e-4, atol=1e-5)
    assert loaded.spec == optimized.spec and loaded.batch_fixed
    with pytest.raises(BladesmithError, match=r"runs \[2, 3, 8, 8\] float32 only \(AOTInd"):
        loaded(x[:1])


def test_a_pt2_holds_the_non_tensor_arguments_it_was_compiled_for(tmp_path):
    """AOTInductor keeps no guard on a non-tensor argument: a model compiled for
    negate=True answered negate=False as if for True. Each value of the test data gets a
    model of its own, and a call with another value is refused in one line."""
    x = torch.randn(2, 4)
    model = Flags().eval()
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x, True), (x, False)], config=QUICK, passes=[]
    )
    both = bladesmith.load(bladesmith.save(optimized, tmp_path / "both.pt2"), trust=True)
    for negate in (True, False):
        torch.testing.assert_close(both(x, negate), model(x, negate), rtol=1e-4, atol=1e-5)
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x, True)], config=QUICK, passes=[]
    )
    one = bladesmith.load(bladesmith.save(optimized, tmp_path / "one.pt2"), trust=True)
    torch.testing.assert_close(one(x, True), model(x, True), rtol=1e-4, atol=1e-5)
    with pytest.raises(BladesmithError) as refused:
        one(x, False)
    message = str(refused.value)
    assert (
        "\n" not in message
        and ("got [2, 4] float32, negate=False, but it runs [2, 4] float32, negate=True only")
        in message
    )
