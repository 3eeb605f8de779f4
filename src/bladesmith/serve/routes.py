"""The routes the request front (``front``) forwards to tritonserver, and the kind of each:
how the front checks a request on it.

HTTP: health (live, ready), server and model metadata, model ready, config and
statistics, inference of the served models; gRPC: the same methods. The path is read as
sent and must already be canonical: segments of letters, digits, ``_``, ``-`` and ``.``
(not first), no ``%``, ``//``, ``.``/``..`` segment, trailing ``/`` or query (else 400);
an unknown path is 404, a known one with another method 405, an unknown gRPC method
UNIMPLEMENTED, a model this server does not serve 404 / NOT_FOUND. tritonserver's
generate, logging, trace and repository APIs are never reached. (Shared memory's routes
are served as ``front`` says.)

Part of the front's process: like it, it imports neither torch nor bladesmith.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bladesmith.serve.request_checks import NAME, Model, Refused

_CANONICAL = re.compile(r"(?:/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}){1,8}")
_MODEL = rf"/v2/models/(?P<model>{NAME})(?:/versions/(?P<version>[1-9][0-9]{{0,17}}))?"
_SHARED = r"/v2/(?:system|cuda)sharedmemory"
# (path, method, kind): what the front forwards, and how it checks it.
HTTP_ROUTES = [
    (re.compile(pattern), method, kind)
    for pattern, method, kind in (
        (r"/v2/health/(?:live|ready)", "GET", "plain"),
        (r"/v2", "GET", "plain"),
        (r"/v2/models/stats", "GET", "plain"),
        (_MODEL, "GET", "model"),
        (_MODEL + r"/(?:ready|config|stats)", "GET", "model"),
        (_MODEL + r"/infer", "POST", "infer"),
        (rf"{_SHARED}(?:/region/{NAME})?/status", "GET", "shared"),
        (rf"{_SHARED}(?:/region/{NAME})?/unregister", "POST", "shared"),
        (rf"/v2/systemsharedmemory/region/{NAME}/register", "POST", "register"),
        (rf"/v2/cudasharedmemory/region/{NAME}/register", "POST", "shared-json"),
    )
]
# gRPC method: kind (as above).
GRPC_METHODS = {
    "ServerLive": "plain", "ServerReady": "plain", "ServerMetadata": "plain",
    "ModelReady": "model", "ModelMetadata": "model", "ModelConfig": "model",
    "ModelStatistics": "statistics", "ModelInfer": "infer", "ModelStreamInfer": "infer",
    "SystemSharedMemoryStatus": "shared", "SystemSharedMemoryRegister": "register",
    "SystemSharedMemoryUnregister": "shared", "CudaSharedMemoryStatus": "shared",
    "CudaSharedMemoryRegister": "shared", "CudaSharedMemoryUnregister": "shared",
}  # fmt: skip


@dataclass(frozen=True)
class Route:
    path: str
    kind: str  # plain, model, infer, shared, shared-json, register
    model: Model | None


def http_route(target: str, method: str, models: dict[str, Model]) -> Route:
    """The route of a request for ``target`` (the path as sent); Refused: 400 where the
    path is not canonical, 404 where no route or model is there, 405 for another
    method."""
    if not _CANONICAL.fullmatch(target):
        raise Refused(
            f"path {target[:200]!r}: not a plain path (this server takes segments of "
            "letters, digits, '_', '-' and '.', not first; no '%', '//', query or "
            "trailing '/')"
        )
    methods = []
    for pattern, allowed, kind in HTTP_ROUTES:
        found = pattern.fullmatch(target)
        if not found:
            continue
        if method != allowed:
            methods.append(allowed)
            continue
        name = found.groupdict().get("model")
        if name is not None and name not in models:
            raise Refused(f"model {name!r}: not served here (serving {served_names(models)})", 404)
        return Route(target, kind, models.get(name) if name else None)
    if methods:
        raise Refused(f"{target}: takes {' or '.join(methods)}, not {method[:20]}", 405)
    raise Refused(f"{target}: no such route on this server", 404)


def answer_encoding(accepted: str | None) -> str:
    """What tritonserver may compress an answer with for a client that sent
    ``accepted`` (its Accept-Encoding): gzip or deflate where the client takes it,
    else identity (none)."""
    taken = set()
    for item in (accepted or "").lower().split(","):
        coding, _, weight = item.partition(";")
        weight = weight.strip().removeprefix("q=")
        if not re.fullmatch(r"0(\.0*)?", weight):
            taken.add(coding.strip())
    return next((coding for coding in ("gzip", "deflate") if coding in taken), "identity")


def served_names(models: dict) -> str:
    return ", ".join(models) or "nothing"
