"""How ``bladesmith serve`` stops: the requests that had arrived are answered, later ones
are refused as unavailable, and no client is told that the model does not exist.

Triton 2.51 (the bundled server) answers a request for a model it is unloading, or has
unloaded, with HTTP 404 / gRPC NOT_FOUND, which clients and load balancers take as
final. Its own stop cannot avoid that. On SIGINT it refuses new HTTP connections but
answers the open ones until they close or its exit timeout passes, then unloads the
models while gRPC still answers (NOT_FOUND for as long as that takes, seconds). Where
clients kept their connections open that long, it has no time left to unload them and
exits with an error. Unloading the models before the signal answers every request after
that with 404.

So ``Server.stop`` does not let Triton unload anything: the model instances answer the
requests that had arrived, those being computed and those queued behind them, and refuse
every later one with UNAVAILABLE (HTTP 503, gRPC UNAVAILABLE: send it again, to another
server); once those are answered and sent, tritonserver's processes are ended.

Which requests had arrived: Triton's dynamic batcher hands a model version's requests to
its instances in arrival order (one FIFO queue, no priorities), and its metrics say how
many wait in that queue (``nv_inference_pending_request_count``, updated as each request
enters and leaves it). The instances count the requests they take (``taken``). At the
stop the server reads the queue's length P, then ``taken`` S, and sets ``cutoff`` to
S + P + two batches per instance. A batch per instance may have left the queue and not be
counted yet when P is read. And instances count in the order they reach their gate, not
the order they took from the queue, so up to a batch per instance may be counted ahead
of an earlier one. An instance computes a batch whose first request's number (the
requests taken before it, plus one) is at most the cutoff and refuses the others: a few
requests that arrived just after the stop are answered too.

Every request that had arrived has been taken once ``taken`` reaches the cutoff, or
``_TRANSIT_S`` after the queue was read empty (a batch that left the queue reaches its
gate within that: a guess, not a signal Triton gives). When that holds and no batch is
being computed, the cutoff is lowered to ``taken``, so that nothing more is admitted.
Where the queue cannot be read (the metrics endpoint does not answer), the cutoff is
``taken``: every later batch is refused, queued requests included, and the stop says so.

The server and its instances share a folder, which ``ENVIRONMENT`` names to the
instances: ``state`` holds each model version's counts (JSON, read and written under
its lock; instances are separate processes), and each computation holds ``computing``
locked shared, so that the server's exclusive lock on it says when none is under way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

ENVIRONMENT = "BLADESMITH_SERVE_STOP"
_STATE = "state"
_COMPUTING = "computing"
_POLL_S = 0.02
# A batch that has left Triton's queue reaches its instance's gate within this (a Python
# backend hands it over through shared memory, usually in well under a millisecond); a
# stub stalled longer than this (a machine far overloaded) may see a request that had
# arrived refused.
_TRANSIT_S = 0.5
# Answers leave an instance through shared memory before Triton writes them out: nothing
# unacknowledged for this long is taken to mean none is still on its way (a guess, not a
# signal Triton gives; an answer Triton takes longer to hand over can be cut off).
_QUIET_S = 0.5
_PENDING = re.compile(r"^nv_inference_pending_request_count\{(.*)\} (\S+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def environment(folder: Path) -> dict[str, str]:
    """The variables by which a server's model instances follow its stop in ``folder``."""
    (folder / _COMPUTING).touch()
    (folder / _STATE).write_text("{}")
    return {ENVIRONMENT: str(folder)}


def pending_requests(metrics: str) -> dict[str, int]:
    """Each model version's queued requests ("model/version": count) in a page of
    Triton's metrics."""
    found = {}
    for labels, value in _PENDING.findall(metrics):
        named = dict(_LABEL.findall(labels))
        found[f"{named.get('model')}/{named.get('version')}"] = int(float(value))
    return found


class _Shared:
    """The folder's ``state`` and ``computing`` files, open (a lock belongs to the open file)."""

    def __init__(self, folder: Path):
        self._state = open(folder / _STATE, "r+")  # noqa: SIM115 - open for the owner's life
        self._computing = open(folder / _COMPUTING)  # noqa: SIM115

    def close(self) -> None:
        self._state.close()
        self._computing.close()

    @contextmanager
    def counts(self):
        """Each model version's counts, under the state file's lock, written back on exit."""
        import fcntl  # POSIX only, as tritonserver: importing bladesmith.serve works anywhere

        fcntl.flock(self._state, fcntl.LOCK_EX)
        try:
            self._state.seek(0)
            models = json.loads(self._state.read())
            yield models
            self._state.seek(0)
            self._state.truncate()
            self._state.write(json.dumps(models))
            self._state.flush()
        finally:
            fcntl.flock(self._state, fcntl.LOCK_UN)

    def hold(self, held: bool) -> None:
        """Hold ``computing`` shared (a computation under way), or let it go. Taken under
        the state lock, so it never waits: the server locks it only under that lock."""
        import fcntl

        fcntl.flock(self._computing, fcntl.LOCK_SH if held else fcntl.LOCK_UN)

    def idle(self) -> bool:
        """Whether no computation is under way (call under the state lock, which keeps
        any from starting until it is released)."""
        import fcntl

        try:
            fcntl.flock(self._computing, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self._computing, fcntl.LOCK_UN)
        return True


def refuse_and_drain(
    folder: Path,
    timeout: float,
    pending: Callable[[], dict[str, int]],
    cut_short: threading.Event | None = None,
) -> str | None:
    """Have the instances answer the requests that had arrived and refuse later ones (the
    module doc says how); ``pending()`` reads each model version's queued requests from
    Triton's metrics. Returns once those are answered, or after ``timeout`` seconds, or
    as soon as ``cut_short`` is set (the caller says so); then nothing more is admitted.
    What went wrong, in a few words; None when nothing did."""
    shared = _Shared(folder)
    try:
        problem = _set_cutoffs(shared, pending)
        deadline = time.monotonic() + timeout
        emptied = None  # when the queues with requests still to take were read empty
        while True:
            with shared.counts() as models:
                waiting = [key for key, c in models.items() if c["taken"] < c["cutoff"]]
                if emptied is not None and time.monotonic() - emptied >= _TRANSIT_S:
                    waiting = []
                done = not waiting and shared.idle()
                late = not done and time.monotonic() > deadline
                if done or late or (cut_short is not None and cut_short.is_set()):
                    for counts in models.values():
                        counts["cutoff"] = counts["taken"]  # nothing more is admitted
                    break
            if waiting and emptied is None:
                # Read empty once, the queues hold no request that had arrived (later ones
                # are numbered after them): no need to read them again.
                with contextlib.suppress(OSError, ValueError):
                    queued = pending()
                    if all(queued.get(key) == 0 for key in waiting):
                        emptied = time.monotonic()
            time.sleep(_POLL_S)
    finally:
        shared.close()
    if late:
        unanswered = f"requests that had arrived were unanswered after {timeout:.0f} s"
        return "; ".join(filter(None, (problem, unanswered)))
    return problem


def _set_cutoffs(shared: _Shared, pending: Callable[[], dict[str, int]]) -> str | None:
    """Each model version's cutoff: the queue's length read first, then what was taken (the
    module doc says why in that order). What went wrong, None when nothing did."""
    try:
        queued, unread = pending(), None
    except (OSError, ValueError) as error:
        queued, unread = {}, str(error)
    with shared.counts() as models:
        missing = [key for key in models if key not in queued]
        for key, counts in models.items():
            margin = 2 * counts["instances"] * counts["batch"]
            # An unknown queue: refuse from now on, queued requests included.
            counts["cutoff"] = counts["taken"] + (queued[key] + margin if key in queued else 0)
    if not missing:
        return None
    reason = unread or f"no pending count for {', '.join(missing)}"
    return (
        f"requests queued at the stop were refused (Triton's metrics did not count them: {reason})"
    )


def wait_sent(ports: set[int], timeout: float, cut_short: threading.Event | None = None) -> None:
    """Wait (at most ``timeout`` seconds, and no longer once ``cut_short`` is set) until
    what the server has written on the connections to ``ports`` has reached their
    clients: nothing unacknowledged for ``_QUIET_S``. Clients still sending (and
    refused) keep it waiting to the end."""
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and not (cut_short is not None and cut_short.is_set()):
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
    """A model instance's side of the stop, for model ``model`` version ``version``
    batching up to ``max_batch`` requests."""

    def __init__(self, folder: str, model: str, version: str, max_batch: int):
        self._shared = _Shared(Path(folder))
        self._key = f"{model}/{version}"
        with self._shared.counts() as models:
            counts = models.setdefault(
                self._key, {"instances": 0, "batch": 1, "taken": 0, "cutoff": None}
            )
            counts["instances"] += 1
            counts["batch"] = max(counts["batch"], max_batch)

    @contextmanager
    def admitted(self, requests: int):
        """Yields whether to compute this batch of ``requests`` (False: it arrived after
        the stop), holding ``computing`` shared meanwhile when it is computed."""
        with self._shared.counts() as models:
            counts = models[self._key]
            # The batch's first request is number taken + 1: admitted while <= cutoff.
            admitted = counts["cutoff"] is None or counts["taken"] < counts["cutoff"]
            counts["taken"] += requests
            if admitted:
                self._shared.hold(True)
        try:
            yield admitted
        finally:
            if admitted:
                self._shared.hold(False)


def admission(model: str, version: str, max_batch: int):
    """This model instance's ``admitted(requests)``: its gate's under bladesmith serve;
    under another server (a repository from ``export triton``) every batch is admitted."""
    folder = os.environ.get(ENVIRONMENT)
    if not folder:
        return lambda requests: nullcontext(True)
    return Gate(folder, model, version, max_batch).admitted
