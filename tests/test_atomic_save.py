"""``save`` replaces the artifact and its libraries folder together: a save that fails,
or whose process is ended mid-way, leaves the previous artifact whole and loadable, and
no temporary file (a killed process's, the next save removes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import bladesmith
from bladesmith import _files
from bladesmith.fresh_load import run_saved
from bladesmith.runtimes import torchscript
from test_artifact import optimized_net


def _names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_failed_write_leaves_the_previous_artifact_and_its_folder(tmp_path, monkeypatch):
    optimized, _, x = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    libs = tmp_path / "net.pt.libs"  # as if the previous save had stored a library
    libs.mkdir()
    (libs / "libraries.json").write_text("[]")
    before = path.read_bytes()

    def broken(module, calls, path, metadata, **_):
        path.write_bytes(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(torchscript.FORMAT, "write", broken)  # the writer FORMATS calls
    with pytest.raises(OSError, match="disk full"):
        bladesmith.save(optimized, path)
    assert path.read_bytes() == before and _names(tmp_path) == ["net.pt", "net.pt.libs"]
    assert _names(libs) == ["libraries.json"]


def test_a_save_replaces_the_folder_with_the_new_ones(tmp_path):
    optimized, _, x = optimized_net()
    (tmp_path / "net.pt.libs").mkdir()
    (tmp_path / "net.pt.libs" / "old.so").write_bytes(b"old")
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    assert _names(tmp_path) == ["net.pt"]  # this model calls no library: no folder
    torch.testing.assert_close(bladesmith.load(path)(x), optimized(x))


# Saves once, then again with a writer that stops half-way, saying so.
_SAVING = """
import sys, time
sys.path.insert(0, {tests!r})
import bladesmith
from bladesmith.runtimes import torchscript
from test_artifact import optimized_net

optimized, _, _ = optimized_net()
bladesmith.save(optimized, {path!r})

def stalled(module, calls, path, metadata, **options):
    path.write_bytes(b"half a model")
    print("writing", flush=True)
    time.sleep(600)

torchscript.FORMAT.write = stalled
bladesmith.save(optimized, {path!r})
"""


@pytest.mark.parametrize("end", [signal.SIGTERM, signal.SIGKILL])
def test_a_save_ended_mid_way_leaves_the_previous_artifact_loadable(tmp_path, end):
    path = tmp_path / "net.pt"
    script = _SAVING.format(tests=str(Path(__file__).parent), path=str(path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    saving = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert saving.stdout.readline() == "writing\n"
        before = path.read_bytes()
        saving.send_signal(end)
        saving.wait(timeout=60)
    finally:
        saving.kill()
    time.sleep(0.1)
    assert path.read_bytes() == before
    optimized, _, x = optimized_net()
    outputs, problem = run_saved(path, (x,))
    assert problem is None
    torch.testing.assert_close(outputs, optimized(x))
    if end == signal.SIGTERM:  # ended cleanly: nothing left
        assert _names(tmp_path) == ["net.pt"]
    else:  # killed outright: its temporary file and folder stay until the next save
        assert [name.split(".saving-")[0] for name in _names(tmp_path)[:2]] == [
            ".net.pt.libs",
            ".net.pt",
        ]
        bladesmith.save(optimized, path)
        assert _names(tmp_path) == ["net.pt"]


def test_a_running_saves_files_are_not_removed(tmp_path):
    """What another save, still running, writes beside the same target stays."""
    path = tmp_path / "net.pt"
    running = tmp_path / f".net.pt{_files._SAVING}{os.getpid()}-0000.pt"
    running.write_bytes(b"in progress")
    with _files.replacing(path, tmp_path / "net.pt.libs") as (file, _):
        file.write_bytes(b"model")
    assert _names(tmp_path) == [running.name, "net.pt"]
