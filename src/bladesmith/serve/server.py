"""Run Triton Inference Server: the one bundled with the ``nvidia-pytriton`` package, with
its Python backend, on a model repository.

    with Server(repository, http_port=8000) as server:   # started, ready
        ...                                               # stopped on exit, requests drained

The environment is set for the Python backend's stub: it embeds Python through
``libpython``, and the system's libpython does not match an interpreter built elsewhere
(pyenv, conda: model initialisation fails with "'_thread.RLock' object has no attribute
'_recursion_count'"), so the running interpreter's own library directory goes first on
LD_LIBRARY_PATH; the interpreter's ``bin`` goes first on PATH (the stub runs with the
virtual environment's packages).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bladesmith.errors import BladesmithError

STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 30.0  # in-flight requests are answered; idle keep-alive connections
# hold the exit up to this long (close clients first)


def tritonserver_home() -> Path:
    """The bundled server: bin/tritonserver, backends/python, python_backend_stubs."""
    try:
        import pytriton
    except ImportError:
        raise BladesmithError(
            "serving needs Triton Inference Server: pip install 'bladesmith[serve]' "
            "(nvidia-pytriton bundles the server)"
        ) from None
    return Path(pytriton.__file__).parent / "tritonserver"


def server_environment() -> dict[str, str]:
    """The environment for tritonserver and the Python backend's stubs (see the module doc)."""
    import pytriton

    env = dict(os.environ)
    bundled_libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    library_path = [sysconfig.get_config_var("LIBDIR"), str(bundled_libs)]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [*library_path, *filter(None, [env.get("LD_LIBRARY_PATH")])]
    )
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _backend_directory(home: Path, into: Path) -> Path:
    """A backends folder whose Python backend has the stub built for this Python version
    (links into the bundle, which is left untouched)."""
    python = into / "python"
    python.mkdir(parents=True)
    for item in (home / "backends" / "python").iterdir():
        if item.name != "__pycache__":
            (python / item.name).symlink_to(item)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise BladesmithError(
            f"serve: the bundled Triton has no Python backend for Python {version}"
        )
    (python / stub.name).symlink_to(stub)
    return into


def _die_with_parent() -> None:
    """In the child: receive SIGTERM when the process that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """tritonserver on ``repository``; ``start()`` returns once it is ready."""

    def __init__(
        self,
        repository: str | Path,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log: str | Path | None = None,
        owns: tempfile.TemporaryDirectory | None = None,
    ):
        self.repository = Path(repository)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log = Path(log) if log else None
        self._process: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None
        self._owns = owns  # removed once the server has stopped (a generated repository)

    @property
    def url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        home = tritonserver_home()
        self._workdir = tempfile.TemporaryDirectory(prefix="bladesmith-triton-")
        backends = _backend_directory(home, Path(self._workdir.name) / "backends")
        command = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={int(SHUTDOWN_TIMEOUT_S)}",
        ]
        output = open(self.log, "ab") if self.log else None  # noqa: SIM115 - the child keeps it
        try:
            self._process = subprocess.Popen(
                command,
                env=server_environment(),
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C reaches us; we stop it
                preexec_fn=_die_with_parent,
            )
        finally:
            if output:
                output.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                hint = f" (log: {self.log})" if self.log else " (its log is above)"
                raise BladesmithError(
                    f"serve: tritonserver exited with code {self._process.returncode} while "
                    f"starting{hint}"
                )
            if self.ready():
                return
            time.sleep(0.25)
        raise BladesmithError(f"serve: tritonserver was not ready after {timeout:.0f} s")

    def _health(self, what: str) -> bool:
        url = f"http://localhost:{self.http_port}/v2/health/{what}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def ready(self) -> bool:
        return self._health("ready")

    def live(self) -> bool:
        return self._health("live")

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self, stop: threading.Event) -> None:
        """Block until ``stop`` is set or the server exits."""
        while self.running() and not stop.wait(0.5):
            pass

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> int | None:
        """SIGINT: Triton stops taking requests, answers those in flight, unloads the
        models and exits; killed if it has not after ``timeout``. Its exit code."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout + 10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
        for owned in (self._workdir, self._owns):
            if owned is not None:
                owned.cleanup()
        self._workdir = self._owns = None
        return code

    def __enter__(self) -> Server:
        return self if self.running() else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
