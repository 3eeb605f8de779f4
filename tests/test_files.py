"""One atomic writer: whole files or none, with the mode a new file gets."""

from __future__ import annotations

import os

import pytest

from bladesmith._files import write_atomically


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_written_file_gets_a_new_files_mode(tmp_path, umask):
    previous = os.umask(umask)
    try:
        path = write_atomically(tmp_path / "a" / "out.json", lambda t: t.write_text("{}"))
        (tmp_path / "plain").write_text("{}")
    finally:
        os.umask(previous)
    assert path.read_text() == "{}"
    assert path.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")

    def half_then_fail(temporary):
        temporary.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(path, half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.json"]
