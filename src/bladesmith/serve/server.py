"""Run Triton Inference Server: the one bundled with the ``nvidia-pytriton`` package, with
its Python backend, on a model repository.

    with Server(repository, http_port=8000) as server:   # started, ready
        ...                                               # stopped on exit, requests drained

The environment is set for the Python backend's stub, which embeds Python through
``libpython``. The system's libpython does not match an interpreter built elsewhere
(pyenv, conda: model initialisation fails with "'_thread.RLock' object has no attribute
'_recursion_count'"), so the running interpreter's own library directory goes first on
LD_LIBRARY_PATH. The interpreter's ``bin`` goes first on PATH (the stub runs with the
virtual environment's packages).

tritonserver listens on Unix sockets in the server's own folder (mode 0700), and the
request front (``front``) on the HTTP and gRPC ports: it forwards only the routes it
knows, each request checked before Triton sees it. tritonserver locks the APIs the
front does not serve (``_restrictions``), so that a way around the front would still
meet a locked door. The regions the Python backend makes in /dev/shm are made the serving
user's alone (mode 0600) as soon as they are seen: the backend sets 0644 itself, so a
local user quick enough to open one in the moment between keeps it (a limit of Triton
2.51 that the security page states). A watch thread ends the server, saying why, when a
model instance dies or stops, or the front does: Triton 2.51 would keep answering
"ready" and fail every request. Child processes are started from one thread that lives
as long as this process, so that they end with the process (PR_SET_PDEATHSIG follows
the thread that started a child), not with the thread that called ``start``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import Future
from pathlib import Path

from bladesmith.errors import BladesmithError
from bladesmith.serve import stopping, workdirs

STARTUP_TIMEOUT_S = 300.0
# Stopping (``stopping`` says why so): the model instances answer the requests that had
# arrived (computed or queued) and refuse later ones, within DRAIN_TIMEOUT_S; their
# answers reach the clients within SEND_TIMEOUT_S; then tritonserver's processes, the
# Python backend's stubs included, are ended. EXIT_TIMEOUT_S is tritonserver's own, where
# another signals it (it gets SIGTERM when the process that started it dies).
DRAIN_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 5.0
EXIT_TIMEOUT_S = 5
DEFAULT_HOST = "127.0.0.1"  # this machine only; "0.0.0.0": every interface
_PORT_FLAGS = ("--http-port", "--grpc-port", "--metrics-port")
WATCH_S = 0.5  # how often the watch thread looks at the model instances
STOPPED_LOOKS = 4  # a stub seen stopped (SIGSTOP) this many looks in a row is stuck
_STUB = "triton_python_backend_stub"
FRONT = Path(__file__).with_name("front.py")


# tritonserver's APIs that the front never passes on open only to a header of this name
# that nobody sends; its shared-memory API (where the front serves it) to one that only
# the front sends. The values are on tritonserver's command line, which every local user
# can read: they open nothing without its sockets (the serving user's alone), and the
# front passes on no header of a client's.
LOCKED_HEADER = "bladesmith-locked"
SHARED_MEMORY_HEADER = "bladesmith-shared-memory"
_LOCKED = ("model-repository", "trace", "logging")


def _restrictions(shared_memory_key: str, shared_memory: bool) -> list[str]:
    """tritonserver's flags that lock the APIs the front does not serve (and shared
    memory, to all but the front)."""
    locked = ",".join(_LOCKED if shared_memory else (*_LOCKED, "shared-memory"))
    nobody = secrets.token_urlsafe(24)
    flags = [
        f"--http-restricted-api={locked}:{LOCKED_HEADER}={nobody}",
        f"--grpc-restricted-protocol={locked}:{LOCKED_HEADER}={nobody}",
    ]
    if shared_memory:
        key = f"{SHARED_MEMORY_HEADER}={shared_memory_key}"
        flags += [
            f"--http-restricted-api=shared-memory:{key}",
            f"--grpc-restricted-protocol=shared-memory:{key}",
        ]
    return flags


class ServerStopError(BladesmithError):
    """tritonserver did not stop cleanly (requests may have been cut off); what was left
    of it has been killed and its shared memory removed."""

    exit_code = 1  # served, then stopped badly: not a usage error


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


class _Spawner:
    """Starts child processes from one daemon thread, which lives as long as this
    process: a child's PR_SET_PDEATHSIG fires when the thread that started it ends."""

    _lock = threading.Lock()
    _queue: queue.Queue | None = None

    @classmethod
    def popen(cls, command: list[str], **options) -> subprocess.Popen:
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue()
                threading.Thread(
                    target=cls._run, args=(cls._queue,), name="bladesmith-spawner", daemon=True
                ).start()
        started: Future = Future()
        cls._queue.put((started, command, options))
        return started.result()

    @staticmethod
    def _run(requests: queue.Queue) -> None:
        while True:
            started, command, options = requests.get()
            try:
                started.set_result(subprocess.Popen(command, **options))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                started.set_exception(error)


def _die_with_parent(umask: int | None = None):
    """In the child: receive SIGTERM when the process that started it dies (and set
    ``umask``)."""
    parent = os.getpid()

    def prepare() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # died before the line above
            os._exit(1)
        if umask is not None:
            os.umask(umask)

    return prepare


def check_port(port: int, flag: str = "--http-port") -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise BladesmithError(f"{flag} {port}: a port is a number from 1 to 65535")
    return port


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on ``host``."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def _url_host(host: str) -> str:
    host = connect_host(host)
    return f"[{host}]" if ":" in host else host


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Each port can be listened on at ``host`` now (else one line naming the flag), and
    no port serves two endpoints."""
    import errno
    import socket

    seen: dict[int, str] = {}
    for flag, port in ports.items():
        check_port(port, flag)
        if port in seen:
            raise BladesmithError(
                f"{seen[port]} and {flag} are both {port}: each endpoint needs its own port"
            )
        seen[port] = flag
    for flag, port in ports.items():
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as error:
            raise BladesmithError(f"--host {host}: not an address here ({error})") from None
        family, kind, protocol, _, address = infos[0]
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton does
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise BladesmithError(
                        f"{flag} {port}: the port is in use on {host} (another server?); "
                        f"choose another {flag}"
                    ) from None
                if error.errno == errno.EACCES:
                    raise BladesmithError(
                        f"{flag} {port}: not allowed to listen on it (ports below 1024 need "
                        f"root); choose another {flag}"
                    ) from None
                raise BladesmithError(f"--host {host}: cannot listen there: {error}") from None


def _group_members(group: int) -> list[int]:
    """The live (not zombie) processes of process group ``group``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def _end_group(group: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL what is left of the process group ``group`` (the Python backend's stubs of
    a tritonserver that crashed ignore SIGTERM) and wait for it to go; the pids found."""
    found = _group_members(group)
    if found:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while _group_members(group) and time.monotonic() < deadline:
            time.sleep(0.1)
    return found


class Server:
    """tritonserver on ``repository`` behind its request front; ``start()`` returns once
    it is ready.

    It listens on ``host`` (default 127.0.0.1: this machine only; "0.0.0.0": every
    interface). The front refuses a request declaring more than ``max_request_bytes`` of
    inputs (default: each model's inputs times its max batch) and shared memory unless
    ``shared_memory`` (then for the serving user's connections only). ``stop()`` has
    the model instances answer the requests that had arrived (those being computed and
    those queued) and refuse later ones (HTTP 503, gRPC UNAVAILABLE), then ends
    tritonserver and its processes (the Python backend's stubs included) and removes
    its shared memory; ``stop_problem`` says why a stop was not clean (None when it
    was). Where a model instance dies or is stopped, or the front does, the server is
    ended within seconds: ``failure`` says which (``running()`` is then False).
    """

    def __init__(
        self,
        repository: str | Path,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = DEFAULT_HOST,
        log: str | Path | None = None,
        owns: tempfile.TemporaryDirectory | None = None,
        max_request_bytes: int | None = None,
        shared_memory: bool = False,
    ):
        self.repository = Path(repository)
        for flag, port in zip(_PORT_FLAGS, (http_port, grpc_port, metrics_port)):
            check_port(port, flag)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.log = Path(log) if log else None
        self.max_request_bytes = max_request_bytes
        self.shared_memory = shared_memory
        self.stop_problem: str | None = None
        self.failure: str | None = None
        self._process: subprocess.Popen | None = None
        self._front: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None
        self._owns = owns  # removed once the server has stopped (a generated repository)
        # The Python backend's shared-memory regions: /dev/shm/PREFIX*, this server's own.
        self._shm_prefix = f"bladesmith_triton_{workdirs.owner_tag()}_{secrets.token_hex(4)}_"
        self._ended = threading.Event()  # set once stop() or the watch ends the server
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"{_url_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{_url_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.metrics_port}/metrics"

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        home = tritonserver_home()
        check_ports_free(
            self.host, dict(zip(_PORT_FLAGS, (self.http_port, self.grpc_port, self.metrics_port)))
        )
        self.stop_problem = self.failure = None
        self._ended.clear()
        self._workdir = workdirs.work_folder("triton")
        folder = Path(self._workdir.name)
        backends = _backend_directory(home, folder / "backends")
        shared_memory_key = secrets.token_urlsafe(24)
        command = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            # No model control: nobody loads or unloads a model through the repository
            # API. HTTP and gRPC on Unix sockets in the folder (the serving user's alone),
            # behind the front; the port numbers are ignored (gRPC's is in its path).
            f"--http-address=unix:{folder / 'http'}",
            "--http-port=1",
            f"--grpc-address=unix:{folder / 'grpc'}",
            "--grpc-port=1",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            *_restrictions(shared_memory_key, self.shared_memory),
        ]
        front = folder / "front.json"
        front.write_text(
            json.dumps(
                {
                    "repository": str(self.repository),
                    "host": self.host,
                    "http_port": self.http_port,
                    "grpc_port": self.grpc_port,
                    "http_socket": str(folder / "http"),
                    "grpc_socket": str(folder / "grpc:1"),
                    "max_request_bytes": self.max_request_bytes,
                    "shared_memory": self.shared_memory,
                    "shared_memory_header": (
                        [SHARED_MEMORY_HEADER, shared_memory_key] if self.shared_memory else None
                    ),
                    "private_prefix": self._shm_prefix,
                }
            )
        )
        try:
            self._launch(command, folder, front)
            stubs = self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        threading.Thread(
            target=self._watch, args=(self._process, self._front, stubs), daemon=True
        ).start()
        return self

    def _launch(self, command: list[str], folder: Path, front: Path) -> None:
        """Start tritonserver and the front (``front``: its config)."""
        output = open(self.log, "ab") if self.log else None  # noqa: SIM115 - the child keeps it
        common = {
            "stdout": output,
            "stderr": subprocess.STDOUT if output else None,
            "stdin": subprocess.DEVNULL,
            "start_new_session": True,  # the terminal's Ctrl-C reaches us; we stop them
        }
        try:
            self._process = _Spawner.popen(
                command,
                env={**server_environment(), **stopping.environment(folder)},
                preexec_fn=_die_with_parent(umask=0o077),  # its files: 0600
                **common,
            )
            # Run as a script: the front imports neither torch nor bladesmith.
            run = f"import runpy; runpy.run_path({str(FRONT)!r}, run_name='__main__')"
            self._front = _Spawner.popen(
                [sys.executable, "-c", run, str(front)], preexec_fn=_die_with_parent(), **common
            )
        finally:
            if output:
                output.close()

    def _wait_ready(self, timeout: float) -> dict[int, str]:
        """Wait for the server to be ready; its model instances (their stubs, see
        ``_stubs``), found before it said so: one that dies as soon as a client sees it
        ready is still watched."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for what, process in (("tritonserver", self._process), ("the front", self._front)):
                if process is None or process.poll() is not None:
                    hint = f" (log: {self.log})" if self.log else " (its log is above)"
                    raise BladesmithError(
                        f"serve: {what} exited with code {process.returncode} while starting{hint}"
                    )
            self._restrict_shared_memory()  # as soon as the backend makes its regions
            stubs = _stubs(self._process.pid)
            if self.ready():
                return stubs
            time.sleep(0.05)
        raise BladesmithError(f"serve: tritonserver was not ready after {timeout:.0f} s")

    def _watch(self, process, front, stubs: dict[int, str]) -> None:
        """End the server, saying why, once a model instance dies or stays stopped, or
        the front exits (until the server is ended otherwise)."""
        stopped = dict.fromkeys(stubs, 0)
        while not self._ended.wait(WATCH_S):
            try:
                failure = _failure(front, stubs, stopped)
                self._restrict_shared_memory()  # a region grown or made anew
            except Exception as error:  # noqa: BLE001 - unwatched, a failure would go unseen
                failure = f"the watch on the model instances failed ({error!r})"
            if failure is None or process.poll() is not None:
                continue  # tritonserver exiting by itself is said by stop()
            with self._lock:
                if self._ended.is_set():
                    return
                self.failure = failure
                print(f"bladesmith serve: {failure}: ending the server", file=sys.stderr)
                _end_group(front.pid)
                _end_group(process.pid)
                process.wait()
                return

    def _health(self, what: str) -> bool:
        url = f"http://{_url_host(self.host)}:{self.http_port}/v2/health/{what}"
        try:
            with urllib.request.urlopen(url, timeout=2.0):
                return True
        except OSError:
            return False

    def ready(self) -> bool:
        return self._health("ready")

    def live(self) -> bool:
        return self._health("live")

    def running(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self._process, self._front))

    def wait(self, stop: threading.Event) -> None:
        """Block until ``stop`` is set or the server exits."""
        while self.running() and not stop.wait(0.5):
            pass

    def stop(
        self, timeout: float = DRAIN_TIMEOUT_S, cut_short: threading.Event | None = None
    ) -> int | None:
        """Answer the requests that had arrived (within ``timeout``), refuse later ones
        (HTTP 503, gRPC UNAVAILABLE), end tritonserver and whatever it started, and remove
        its shared memory; once ``cut_short`` is set, end them without waiting any longer
        (requests may be cut off). Returns tritonserver's exit code where it had exited by
        itself, else 0 (``stop_problem`` says what went wrong, None after a clean stop)."""
        with self._lock:
            self._ended.set()
        process, self._process = self._process, None
        front, self._front = self._front, None
        code = None
        problems, left = [self.failure], []
        if process is not None:
            if process.poll() is None and front is not None and front.poll() is None:
                try:
                    problems.append(
                        stopping.refuse_and_drain(
                            Path(self._workdir.name), timeout, self._pending, cut_short
                        )
                    )
                    # Not a problem when it times out: clients still sending (and refused)
                    # keep the connections busy to the end.
                    stopping.wait_sent({self.http_port, self.grpc_port}, SEND_TIMEOUT_S, cut_short)
                # The work folder gone (a /tmp cleaner) or its state garbled: end anyway.
                except (OSError, ValueError) as error:
                    problems.append(f"the stop could not drain ({error})")
                if cut_short is not None and cut_short.is_set():
                    problems.append("the stop was cut short: requests may have been cut off")
        if front is not None:  # before Triton: it answers what it holds, then closes
            _stop_front(front, cut_short)
        if process is not None:
            exited = process.poll() is not None  # by itself, meanwhile (a crash)
            left = _end_group(process.pid)  # tritonserver and its stubs
            returned = process.wait()  # killed here, unless it had exited by itself
            code, left = (returned, left) if exited else (0, [])
            if code and self.failure is None:
                problems.append(f"tritonserver exited with code {code}")
            if left:
                problems.append(f"killed {len(left)} process(es) it left running")
        self._remove_shared_memory()
        for owned in (self._workdir, self._owns):
            if owned is not None:
                owned.cleanup()
        self._workdir = self._owns = None
        self.stop_problem = "; ".join(filter(None, problems)) or None
        return code

    def _pending(self) -> dict[str, int]:
        """Each model version's requests in Triton's queue, from its metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=2.0) as page:
            return stopping.pending_requests(page.read().decode())

    def _restrict_shared_memory(self) -> None:
        """Make this server's Python-backend regions the serving user's alone (0600)."""
        for region in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
            with contextlib.suppress(OSError):
                if region.stat().st_mode & 0o077:
                    region.chmod(0o600)

    def _remove_shared_memory(self) -> None:
        """This server's Python-backend regions left in /dev/shm (a crash leaves them)."""
        shm = Path("/dev/shm")
        if shm.is_dir():
            for region in shm.glob(f"{self._shm_prefix}*"):
                with contextlib.suppress(OSError):
                    region.unlink()

    def __enter__(self) -> Server:
        return self if self.running() else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_front(front: subprocess.Popen, cut_short: threading.Event | None) -> None:
    """Have the front answer the requests it holds and exit (SIGTERM), ended where it has
    not after its grace, or at once when the stop is ``cut_short``."""
    if front.poll() is None and not (cut_short is not None and cut_short.is_set()):
        front.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            front.wait(SEND_TIMEOUT_S + 2)
    _end_group(front.pid)
    front.wait()


def _failure(front, stubs: dict[int, str], stopped: dict[int, int]) -> str | None:
    """What ends the server, seen in one look: the front exited, or a model instance of
    ``stubs`` died or stayed stopped (``stopped``: looks in a row each was seen stopped)."""
    failure = None
    if front.poll() is not None:
        failure = f"the request front exited (code {front.returncode})"
    for pid, name in stubs.items():
        state = _state(pid)
        stopped[pid] = stopped[pid] + 1 if state == "T" else 0
        if state in ("", "Z", "X"):
            failure = f"model instance {name} (pid {pid}) died"
        elif stopped[pid] >= STOPPED_LOOKS:
            failure = f"model instance {name} (pid {pid}) is stopped (stuck)"
    return failure


def _state(pid: int) -> str:
    """Process ``pid``'s state letter (R, S, T, Z, ...), "" where there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stubs(server: int) -> dict[int, str]:
    """The Python backend's stubs of tritonserver ``server``: pid -> model instance name
    (the word after its backends folder and a number on the stub's command line)."""
    stubs = {}
    for pid in _group_members(server):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if arguments and arguments[0].endswith(_STUB):
            stubs[pid] = arguments[8] if len(arguments) > 8 else f"pid {pid}"
    return stubs
