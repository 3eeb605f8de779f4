"""Libraries beside an artifact are loaded only as its own metadata records them: by
file name inside ``ARTIFACT.libs/``, with the SHA-256 saved; anything else is refused in
one line naming the file, before anything is loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import bladesmith
from bladesmith.errors import BladesmithError
from bladesmith.ops import libraries
from test_artifact import optimized_net

OPERATOR = "plantedops::run"  # registered by no library: restore would load its file


def _artifact(folder: Path, files: dict[str, bytes]) -> tuple[Path, list[dict]]:
    """An artifact path, its libraries folder holding ``files``, and metadata entries
    recording each with its SHA-256."""
    artifact = folder / "model.pt"
    artifact.write_bytes(b"model")
    libs = libraries.folder_beside(artifact)
    libs.mkdir()
    entries = []
    for name, data in files.items():
        (libs / name).write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        entries.append({"file": name, "operators": [OPERATOR], "sha256": digest})
    (libs / "libraries.json").write_text(json.dumps(entries))
    return artifact, entries


def _refusal(artifact: Path, entries: list[dict]) -> str:
    loaded = set(torch.ops.loaded_libraries)
    with pytest.raises(BladesmithError) as refused:
        libraries.restore(artifact, entries)
    assert set(torch.ops.loaded_libraries) == loaded  # nothing loaded
    message = str(refused.value)
    assert "\n" not in message and "refused" in message
    return message


def test_a_planted_library_is_refused(tmp_path):
    artifact, entries = _artifact(tmp_path, {})
    (libraries.folder_beside(artifact) / "evil.so").write_bytes(b"\x7fELF")
    assert "model.pt.libs/evil.so: not a library model.pt records" in _refusal(artifact, [])


@pytest.mark.parametrize("name", ["../evil.so", "/tmp/evil.so", "sub/evil.so", ".."])
def test_a_library_named_outside_the_folder_is_refused(tmp_path, name):
    artifact, _ = _artifact(tmp_path, {})
    (tmp_path / "evil.so").write_bytes(b"\x7fELF")
    entries = [{"file": name, "operators": [OPERATOR], "sha256": "0" * 64}]
    assert f"{name!r} is not a file name in model.pt.libs/" in _refusal(artifact, entries)


def test_an_index_naming_another_library_is_refused(tmp_path):
    artifact, entries = _artifact(tmp_path, {"ops.so": b"\x7fELF ops"})
    index = libraries.folder_beside(artifact) / "libraries.json"
    index.write_text(json.dumps([{**entries[0], "file": "../evil.so"}]))
    assert f"{index}: not the libraries model.pt records" in _refusal(artifact, entries)


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "ops.so").write_bytes(b"\x7fELF ops")
    artifact, _ = _artifact(tmp_path, {})
    link = libraries.folder_beside(artifact) / "ops.so"
    link.symlink_to(outside / "ops.so")
    digest = hashlib.sha256(b"\x7fELF ops").hexdigest()
    entries = [{"file": "ops.so", "operators": [OPERATOR], "sha256": digest}]
    (link.parent / "libraries.json").write_text(json.dumps(entries))
    assert f"{link} is a link out of model.pt.libs/" in _refusal(artifact, entries)


def test_a_library_changed_since_the_save_is_refused(tmp_path):
    artifact, entries = _artifact(tmp_path, {"ops.so": b"\x7fELF ops"})
    library = libraries.folder_beside(artifact) / "ops.so"
    library.write_bytes(b"\x7fELF other")
    assert f"{library} is not the file saved with it" in _refusal(artifact, entries)


def test_load_refuses_an_artifact_with_a_planted_library(tmp_path):
    optimized, _, x = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    assert not libraries.folder_beside(path).exists()  # it calls no library of the user's
    bladesmith.load(path)(x)
    libraries.folder_beside(path).mkdir()
    (libraries.folder_beside(path) / "evil.so").write_bytes(b"\x7fELF")
    with pytest.raises(BladesmithError, match="net.pt.libs/evil.so: not a library net.pt"):
        bladesmith.load(path)
