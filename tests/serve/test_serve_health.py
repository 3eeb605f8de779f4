"""A served model's health is real: a model instance that dies or is stopped ends the
server within seconds, naming it (never a "clean" exit 0); a server started from a thread
outlives the thread; a server killed with SIGKILL leaves work folders that the next
start removes."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")
from serve_testing import free_ports  # noqa: E402
from test_serve_server import (  # noqa: E402
    _children,
    _tritonservers,
    _wait_ready,
    started_serve,
)

import bladesmith  # noqa: E402
from bladesmith.serve.server import Server, _group_members, _state, _stubs  # noqa: E402


def _serve(artifact: Path, log: Path) -> tuple[subprocess.Popen, int]:
    process, http, _, _ = started_serve(artifact, log)
    _wait_ready(http, process, log)
    return process, http


def _owned_folders(pid: int) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"bladesmith-*-{pid}.*"))


def test_a_model_instance_that_dies_ends_serve_with_exit_1_naming_it(net_artifacts, tmp_path):
    log = tmp_path / "serve.log"
    process, http = _serve(net_artifacts[".pt"], log)
    try:
        [tritonserver] = _tritonservers(process.pid)
        [(stub, name)] = _stubs(tritonserver).items()
        assert name == "net_0_0"
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            left = {pid: _state(pid) for pid in [tritonserver, *_group_members(tritonserver)]}
            pytest.fail(f"serve still runs 60 s on; left {left}; log: {log.read_text()[-3000:]}")
        took = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
    said = [line for line in log.read_text().splitlines() if "bladesmith serve: error" in line]
    assert code == 1 and took < 10, (code, took, log.read_text()[-2000:])
    assert len(said) == 1 and f"model instance net_0_0 (pid {stub}) died" in said[0], said
    assert not _group_members(tritonserver)
    assert not _owned_folders(process.pid)


def test_a_model_instance_that_dies_as_the_server_turns_ready_is_watched(
    net_artifacts, tmp_path, monkeypatch
):
    # A client may see the server ready, and its instance die, before start() returns.
    ready, killed = Server.ready, []

    def ready_then_killed(server: Server) -> bool:
        answer = ready(server)
        if answer and not killed:
            killed.extend(_stubs(server._process.pid))
            for stub in killed:
                os.kill(stub, signal.SIGKILL)
        return answer

    monkeypatch.setattr(Server, "ready", ready_then_killed)
    http, grpc, metrics = free_ports(3)
    server = bladesmith.serve(
        net_artifacts[".pt"], http_port=http, grpc_port=grpc, metrics_port=metrics,
        block=False, log=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        [stub] = killed
        assert not server.running()
        assert server.failure == f"model instance net_0_0 (pid {stub}) died"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_killed_leaves_folders_the_next_start_removes_and_a_thread_can_start_it(
    net_artifacts, tmp_path
):
    # SIGKILL: serve cannot clean up; its children end with it (they are told so).
    process, _ = _serve(net_artifacts[".pt"], tmp_path / "killed.log")
    children = _children(process.pid)
    left = _owned_folders(process.pid)
    assert len(left) == 2, left  # the repository's and tritonserver's
    process.kill()
    process.wait()
    deadline = time.monotonic() + 30
    while any(_group_members(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_group_members(pid) for pid in children)
    assert all(folder.exists() for folder in left)

    # The next start removes them; started from a thread that then ends, it keeps serving.
    http, grpc, metrics = free_ports(3)
    started = {}

    def start() -> None:
        started["server"] = bladesmith.serve(
            net_artifacts[".pt"], http_port=http, grpc_port=grpc, metrics_port=metrics, block=False
        )

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    server = started["server"]
    try:
        assert not any(folder.exists() for folder in left)
        time.sleep(2)
        assert server.running() and server.ready()
        with bladesmith.client(server.url, "net") as client:
            assert client(__import__("numpy").zeros((1, 3, 8, 8), "float32"))
        # A stopped (stuck) instance ends it within seconds, naming it.
        [(stub, name)] = _stubs(server._process.pid).items()
        os.kill(stub, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.running() and not server.ready()
        assert server.failure == f"model instance {name} (pid {stub}) is stopped (stuck)"
    finally:
        server.stop()
    assert server.stop_problem.startswith(f"model instance {name} (pid {stub}) is stopped")
