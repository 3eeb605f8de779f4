"""Artifacts loaded and run in a new process: outputs come back, a crash is a reason."""

from __future__ import annotations

import torch

import bladesmith
from bladesmith import fresh_load
from bladesmith.errors import BladesmithError
from test_artifact import optimized_net


def test_a_saved_artifact_runs_in_a_new_process_with_the_same_outputs(tmp_path):
    optimized, _, x = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    outputs, problem = fresh_load.run_saved(path, (x,))
    assert problem is None
    torch.testing.assert_close(outputs, optimized(x))


def test_a_loader_that_crashes_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    optimized, _, x = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    monkeypatch.setattr(fresh_load, "_CHILD", crash)
    outputs, problem = fresh_load.run_saved(path, (x,))
    assert outputs is None
    assert "killed by SIGSEGV" in problem and "crashed" in problem


def test_a_file_that_does_not_load_gives_the_childs_error_line(tmp_path):
    path = tmp_path / "broken.pt"
    path.write_bytes(b"not a model")
    outputs, problem = fresh_load.run_saved(path, (torch.zeros(1),))
    assert outputs is None
    assert "could not load and run it" in problem and "broken.pt" in problem
    assert "\n" not in problem


def test_save_refuses_an_untried_format_whose_new_process_crashes(tmp_path, monkeypatch):
    optimized, spec, _ = optimized_net()
    assert ".pt2" in spec.untried_formats
    monkeypatch.setattr(fresh_load, "_CHILD", "import os, signal; os.abort()")
    target = tmp_path / "net.pt2"
    try:
        bladesmith.save(optimized, target)
    except BladesmithError as error:
        assert "was not kept" in str(error) and "SIGABRT" in str(error)
    else:
        raise AssertionError("save kept a .pt2 that a new process cannot load")
    assert not target.exists()
