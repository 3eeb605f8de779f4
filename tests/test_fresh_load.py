"""Artifacts loaded and run in a new process: outputs come back, a crash is a reason."""

from __future__ import annotations

import time

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


ECHO = """
print("a loader's notice on standard output")
for message in requests():
    reply({"twice": message * 2})
"""


def test_a_conversation_answers_each_request_and_keeps_prints_out_of_the_replies(tmp_path):
    with fresh_load.conversation(ECHO, tmp_path / "unused.pt", None) as ask:
        assert [ask(n) for n in (1, 2, 3)] == [{"twice": 2}, {"twice": 4}, {"twice": 6}]


def test_a_conversation_whose_process_dies_says_why_in_one_line(tmp_path):
    code = "next(requests())\nraise RuntimeError('the file holds no module')"
    with fresh_load.conversation(code, tmp_path / "unused.pt", None) as ask:
        try:
            ask(1)
        except fresh_load.NewProcessFailed as failure:
            assert str(failure) == (
                "a new process could not load and run it (RuntimeError: the file holds no module)"
            )
        else:
            raise AssertionError("a dead process answered")


def test_a_silent_conversation_ends_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(fresh_load, "TIMEOUT_S", 2)
    code = "import time\nnext(requests())\ntime.sleep(60)"
    start = time.monotonic()
    with fresh_load.conversation(code, tmp_path / "unused.pt", None) as ask:
        try:
            ask(1)
        except fresh_load.NewProcessFailed as failure:
            assert "took over" in str(failure)
        else:
            raise AssertionError("a silent process answered")
    assert time.monotonic() - start < 30  # ended, not waited for
