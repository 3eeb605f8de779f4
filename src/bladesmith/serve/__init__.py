"""Serving bladesmith artifacts on Triton Inference Server.

``serve(artifact)`` runs the server (the one bundled with ``nvidia-pytriton``) on a
Python-backend repository of the artifact: dynamic batching up to the artifact's batch,
run in buckets of it and of smaller powers of two, each model instance a process with
its own runner. ``client(url, model)`` answers
images with detections; ``loadtest`` times a server; ``write_repository`` writes a
repository for a standalone server (``bladesmith export triton``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from pathlib import Path

from bladesmith.serve import workdirs
from bladesmith.serve.client import Client, client
from bladesmith.serve.repository import Deployment, write_repository
from bladesmith.serve.server import (
    DEFAULT_HOST,
    Server,
    ServerStopError,
    check_port,
    check_ports_free,
)

__all__ = [
    "Client",
    "Deployment",
    "Server",
    "ServerStopError",
    "client",
    "serve",
    "write_repository",
]


def serve(
    artifact: str | os.PathLike,
    *,
    name: str | None = None,
    libraries: tuple[str | os.PathLike, ...] = (),
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    host: str = DEFAULT_HOST,
    max_batch: int | None = None,
    max_queue_delay_us: int = 500,
    instances: int = 1,
    device: str | None = None,
    image_dtype: str = "float32",
    block: bool = True,
    log: str | os.PathLike | None = None,
    max_request_bytes: int | None = None,
    shared_memory: bool = False,
    trust: bool = False,
) -> Server | None:
    """Serve ``artifact`` (``.ptc``, ``.pt2``, ``.pt``, ``.onnx`` or ``.ov`` from
    ``bladesmith.save``) as model ``name`` (default: the file's stem) on HTTP, gRPC and
    Prometheus-metrics ports of ``host`` (default 127.0.0.1, this machine only;
    ``"0.0.0.0"``: every interface).

    Requests are batched dynamically up to ``max_batch`` rows (default: the artifact's
    batch), waiting at most ``max_queue_delay_us`` for more, and run in full buckets of
    the artifact's batch, the rest in the smallest bucket that holds it (a power of two
    below the batch where the artifact runs at it and answers alike; padded).
    ``instances`` model instances run side by side,
    each in its own process; ``device`` is ``cpu``, ``cuda`` or ``cuda:0,1`` (default: the
    artifact's). ``image_dtype="uint8"`` serves a detector's images as uint8 (a quarter of
    the bytes; made float32 in [0, 1] on the device).

    A request declaring more than ``max_request_bytes`` of inputs (default: the model's
    inputs times its max batch) is refused (HTTP 400, gRPC INVALID_ARGUMENT) before anything
    is allocated, as is any request that is not one for the model. Triton's shared-memory
    API is refused unless ``shared_memory``, and then served to this user's connections
    only. Where a model instance dies or is stopped, the server is ended within seconds
    (``serve`` raises ``ServerStopError`` naming it). ``trust``: as ``bladesmith.load``'s
    (an artifact whose loading runs code it brings is refused without it).

    ``block``: serve until SIGINT or SIGTERM, then stop (the requests that had arrived are
    answered, later ones refused with HTTP 503 / gRPC UNAVAILABLE; a second signal ends
    the server without waiting). It raises ``ServerStopError`` if tritonserver did not
    stop cleanly or was stopped by a second signal (what was left of it is killed all the
    same). Without ``block`` it returns the started ``Server`` (a context manager; ``stop()``
    it).
    """
    ports = {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port}
    for flag, port in ports.items():
        check_port(port, flag)
    check_ports_free(host, ports)  # before the work of writing the repository
    # CPU instances split the cores between them (a GPU artifact's threads barely work).
    threads = max(1, (os.cpu_count() or 1) // instances) if instances > 1 else 0
    deployment = Deployment(
        max_batch,
        max_queue_delay_us,
        instances,
        device,
        threads,
        image_dtype=image_dtype,
        trust=trust,
    )
    workdir = workdirs.work_folder("serve")
    repository = Path(workdir.name) / "models"
    write_repository(
        artifact,
        repository,
        name=name,
        backend="python",
        deployment=deployment,
        libraries=tuple(libraries),
        link=True,
    )
    server = Server(
        repository,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        host=host,
        log=log,
        owns=workdir,
        max_request_bytes=max_request_bytes,
        shared_memory=shared_memory,
    )
    server.start()
    if not block:
        return server
    # The first signal stops the server; a second one cuts the stop short.
    stop, cut_short = threading.Event(), threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: (cut_short if stop.is_set() else stop).set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        model = name or Path(artifact).stem
        where = " (listening on every interface)" if host in ("0.0.0.0", "::") else ""
        print(
            f"serving {model}: http {server.url}, grpc {server.grpc_url}, "
            f"metrics {server.metrics_url}{where} (Ctrl-C or SIGTERM to stop)",
            file=sys.stderr,
            flush=True,
        )
        server.wait(stop)
    finally:
        code = server.stop(cut_short=cut_short)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not stop.is_set():
        if server.failure:
            raise ServerStopError(
                f"serve: {server.failure}, so the server was ended (its log is above): "
                "start it again"
            )
        raise ServerStopError(
            f"serve: tritonserver exited on its own (code {code}; its log is above)"
        )
    if cut_short.is_set():
        raise ServerStopError(
            "serve: stopped at a second signal without waiting for the requests under way: "
            "they may have been cut off (tritonserver was ended and its shared memory removed)"
        )
    if server.stop_problem:
        raise ServerStopError(
            f"serve: tritonserver did not stop cleanly: {server.stop_problem} (what was left "
            "of it has been killed and its shared memory removed)"
        )
    return None


class _CallablePackage(types.ModuleType):
    """``bladesmith.serve`` is this package (imported as such by its submodules) and the
    function: ``bladesmith.serve(artifact)`` calls ``serve``."""

    def __call__(self, *args, **kwargs):
        return serve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
