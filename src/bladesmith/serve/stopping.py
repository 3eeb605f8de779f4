"""How ``bladesmith serve`` stops without telling a client that the model does not exist.

Triton 2.51 (the bundled server) answers a request for a model it is unloading, or has
unloaded, with HTTP 404 / gRPC NOT_FOUND, which clients and load balancers take as
final. Its own stop cannot avoid that: on SIGINT it refuses new HTTP connections but
answers the open ones until they close or its exit timeout passes, then unloads the
models while gRPC still answers (NOT_FOUND for as long as that takes, seconds), and
where clients kept their connections open that long it has no time left to unload them
and exits with an error; unloading the models before the signal answers every request
after that with 404.

So ``Server.stop`` does not let Triton unload anything: each model instance refuses every
request it is given from then on with UNAVAILABLE (HTTP 503, gRPC UNAVAILABLE: send it
again, to another server); once the batches the instances were computing are done and
their answers sent, tritonserver's processes are ended.

The server and its instances share a folder, which ``ENVIRONMENT`` names to the
instances: ``stopping`` appears when the stop begins, and each computation holds
``computing`` locked shared, so that the server's exclusive lock on it waits for the
computations under way.
"""

from __future__ import annotations

import contextlib
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ENVIRONMENT = "BLADESMITH_SERVE_STOP"
_STOPPING = "stopping"
_COMPUTING = "computing"
_POLL_S = 0.02
# Answers leave an instance through shared memory before Triton writes them out: nothing
# unacknowledged for this long is taken to mean none is still on its way (a guess, not a
# signal Triton gives; an answer Triton takes longer to hand over can be cut off).
_QUIET_S = 0.5


def environment(folder: Path) -> dict[str, str]:
    """The variables by which a server's model instances follow its stop in ``folder``."""
    (folder / _COMPUTING).touch()
    return {ENVIRONMENT: str(folder)}


def refuse_and_drain(folder: Path, timeout: float) -> bool:
    """Have every instance refuse what it is given from now on; whether the batches they
    were computing were done within ``timeout`` seconds."""
    import fcntl  # POSIX only, as tritonserver: importing bladesmith.serve works anywhere

    (folder / _STOPPING).touch()
    deadline = time.monotonic() + timeout
    with open(folder / _COMPUTING) as computing:
        while True:
            try:
                fcntl.flock(computing, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_S)


def wait_sent(ports: set[int], timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) until what the server has written on the
    connections to ``ports`` has reached their clients: nothing unacknowledged for
    ``_QUIET_S``. Clients still sending (and refused) keep it waiting to the end."""
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        now = time.monotonic()
        if _unacknowledged(ports):
            quiet_since = now
        elif now - quiet_since >= _QUIET_S:
            return
        time.sleep(_POLL_S)


def _unacknowledged(ports: set[int]) -> int:
    """Bytes sent from local ``ports`` that the other end has not acknowledged yet (each
    connection's tx_queue in /proc/net/tcp and tcp6)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, _, _, queues = line.split()[1:5]
                if int(local.rsplit(":", 1)[1], 16) in ports:
                    total += int(queues.split(":")[0], 16)
    return total


class Gate:
    """A model instance's side of the stop."""

    def __init__(self, folder: str):
        self._stopping = Path(folder) / _STOPPING
        # Open for the instance's life: a lock belongs to the open file.
        self._computing = open(Path(folder) / _COMPUTING)  # noqa: SIM115

    @contextmanager
    def admitted(self):
        """Yields whether to compute the batch (False: the server is stopping), holding
        the shared lock meanwhile."""
        import fcntl

        try:
            fcntl.flock(self._computing, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # the server holds it: stopping
            yield False
            return
        try:
            yield not self._stopping.exists()
        finally:
            fcntl.flock(self._computing, fcntl.LOCK_UN)


def admission():
    """This model instance's ``admitted()``: its gate's under bladesmith serve; under
    another server (a repository from ``export triton``) every batch is admitted."""
    folder = os.environ.get(ENVIRONMENT)
    return Gate(folder).admitted if folder else lambda: nullcontext(True)
