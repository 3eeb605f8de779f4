"""The format contract (``runtimes/format.py``): every format in ``FORMATS`` is tried by
``optimize``, saved, reloaded in a new process with the same outputs, and listed by the
command line; a format that leaves a duty unfilled fails when defined or created.
Parametrized over ``FORMATS``: a new format is covered without touching this file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torchvision

import bladesmith
from bladesmith.config import Config
from bladesmith.passes import registry
from bladesmith.runtimes.format import Format
from bladesmith.runtimes.formats import FORMATS
from engine_testing import Wasteful
from test_reload import reload_in_new_process

# Built by a pass that runs on a CPU only at o2 and compiles for minutes there (Inductor).
_O2_ON_A_CPU = {".ptc"}


def _formats() -> list:
    return [
        # One that builds for minutes (an AOTInductor package) is a slow test.
        pytest.param(
            suffix,
            marks=[pytest.mark.slow]
            if each.build_cost == "minutes" or suffix in _O2_ON_A_CPU
            else [],
        )
        for suffix, each in FORMATS.items()
    ]


@pytest.fixture(scope="module")
def model_and_input():
    """A torchvision model no part of bladesmith was written for, small enough to time
    quickly, large enough that a runtime built for the CPU beats eager PyTorch on it."""
    torch.manual_seed(0)
    return torchvision.models.mobilenet_v3_small(weights=None).eval(), torch.rand(1, 3, 64, 64)


@pytest.mark.parametrize("suffix", _formats())
def test_every_format_is_tried_saved_and_reloaded_in_a_new_process(
    suffix, model_and_input, tmp_path
):
    each = FORMATS[suffix]
    if each.missing_package():
        pytest.skip(each.missing_package())
    model, x = model_and_input
    # A format that holds only its own pass's runner needs that pass kept (Wasteful: it
    # wins whatever the load of the machine); the others hold the model as given.
    if each.only_its_pass:
        model = Wasteful(model).eval()
    passes = (
        [p for p in registry.create_all() if p.saves_as == suffix] if each.only_its_pass else []
    )
    config = Config(warmup=1, iters=5, save_as=suffix, progress=False)
    optimized, spec, report = bladesmith.optimize(
        model,
        device="cpu",
        level="o2" if suffix in _O2_ON_A_CPU else "o1",
        test_data=[(x,)],
        config=config,
        passes=passes,
    )
    assert suffix in (*spec.save_formats, *spec.untried_formats), (
        spec.refused_formats.get(suffix),
        [(r.name, r.status, r.reason) for r in report.optimizations],
    )
    path = bladesmith.save(optimized, tmp_path / f"model{suffix}")
    with torch.no_grad():
        expected = optimized(x)
    printed = reload_in_new_process(path, (x,), expected, tmp_path, rtol=1e-3, atol=1e-4)
    assert printed.startswith("cpu ")


def test_the_command_line_lists_every_format():
    done = subprocess.run(
        [sys.executable, "-m", "bladesmith", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    listed = {each["suffix"]: each for each in json.loads(done.stdout)["formats"]}
    assert list(listed) == list(FORMATS)
    for suffix, each in FORMATS.items():
        assert listed[suffix]["description"] == each.description
        assert listed[suffix]["triton_backend"] == (each.triton_backend or "python")


def test_out_takes_every_format_and_refuses_another_suffix(tmp_path, capsys):
    from bladesmith.cli.args import save_file

    for suffix in FORMATS:
        assert save_file(str(tmp_path / f"m{suffix}")) == str(tmp_path / f"m{suffix}")
    with pytest.raises(Exception, match="expected a .* file"):
        save_file(str(tmp_path / "m.zip"))


def test_an_incomplete_format_fails_where_it_is_defined_or_created():
    with pytest.raises(TypeError, match="does not declare description"):

        class NoDescription(Format):  # noqa: F841
            suffix = ".x"

    class NoReader(Format):
        suffix, description, devices, build_cost = ".x", "x", ("cpu",), "seconds"
        zip_archive = needs_fake_kernels = False
        triton_backend = None

        def write(self, module, calls, path, metadata, *, key, **options):
            pass

        def metadata(self, path, key):
            return None

    with pytest.raises(TypeError, match="abstract method.*read"):
        NoReader()
