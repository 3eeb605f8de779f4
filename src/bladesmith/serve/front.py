"""The request front of ``bladesmith serve``: the only door to its tritonserver.

tritonserver listens on Unix sockets in the server's own folder (mode 0700: the serving
user's alone); this process listens on the HTTP and gRPC ports. It is an allowlist, not
a filter: it forwards the routes it knows, each rebuilt from what it checked, and
answers everything else itself.

- Routes (``routes``): the HTTP paths (read as sent, canonical) and gRPC methods it
  knows, for the models it serves; tritonserver's generate, logging, trace and
  repository APIs are never reached.
- Inference (``request_checks``): a request for a served model, of its inputs, outputs
  and known parameters, declaring at most the model's limit of tensor bytes, its body
  holding what it declares; tritonserver receives it as the front re-encodes it from
  what it checked, never the bytes sent.
- Shared memory (registering regions, their status, requests naming them) is refused
  unless the server was started with ``--shared-memory``, and then served only to
  connections of the serving user, for regions that are the serving user's alone
  (``shared_memory_owners``).
- Bounds. A body larger than the limit allows is refused from its Content-Length,
  unread; request bodies being received at once are bounded in total (429 /
  RESOURCE_EXHAUSTED past it); each port takes a bounded number of connections (more
  are answered 503 and closed: the process never runs out of file descriptors); a
  connection that sends no request for ``IDLE_S`` and a body that stops coming for
  ``BODY_IDLE_S`` are closed (408). Errors are one line (no log flood).
- Behind it, tritonserver restricts its shared-memory API to a header that only the
  front sends (and only where it serves shared memory), and its repository, trace and
  logging APIs to a header nobody sends; the front passes on no header or gRPC metadata
  of the client's (the answers' compression excepted: none unless the client asks).

Run as a script (``python front.py CONFIG``, which ``Server`` does), it imports neither
torch nor bladesmith: its modules above come from its folder, without bladesmith's
packages (whose ``__init__`` would import torch). CONFIG (JSON) names the ports, the
sockets, the repository whose ``config.pbtxt`` files give the models' inputs and outputs,
the limit, whether shared memory is served, the header that opens it and the Python
backend's region prefix.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import sys
import time
import zlib
from pathlib import Path

if __name__ == "__main__" and "bladesmith" not in sys.modules:
    # Run as a script: bladesmith and bladesmith.serve as bare packages of their folders,
    # so that the front's modules below are imported without running their __init__.
    import types

    _serve = Path(__file__).resolve().parent
    for _name, _folder in (("bladesmith", _serve.parent), ("bladesmith.serve", _serve)):
        sys.modules[_name] = types.ModuleType(_name)
        sys.modules[_name].__path__ = [str(_folder)]

from bladesmith.serve.request_checks import (  # noqa: E402
    HEADER_ROOM,
    JSON_PER_BYTE,
    Model,
    Refused,
    as_binary,
    check_grpc_infer,
    check_http_infer,
    check_keys,
    models_of,
    strict_json,
)
from bladesmith.serve.routes import (  # noqa: E402
    GRPC_METHODS,
    answer_encoding,
    http_route,
    served_names,
)
from bladesmith.serve.shared_memory_owners import check_region, connection_owner  # noqa: E402

# A connection that sends no (complete) request for this long is closed, before its
# first request and between requests; gRPC's likewise (its handshake, then idle).
IDLE_S = 10.0
# A body that stops coming for this long is refused (408): a client that sent less than
# its Content-Length would otherwise hold its connection, and the memory read, forever.
BODY_IDLE_S = 10.0
# A body must have come whole within this (one trickling a byte at a time would hold
# its connection for as long as it likes).
BODY_S = 300.0
# A gRPC connection is closed after this (its calls given the grace to end): a call
# whose message never comes whole would otherwise hold its connection for ever.
GRPC_CONNECTION_S = 600.0
GRPC_GRACE_S = 60.0
# Connections per port; fewer where the process may open fewer files (each HTTP
# connection may hold one to tritonserver too).
MAX_CONNECTIONS = 1000
SPARE_FILES = 256
# A connection over the limit is told so, and closed once it has sent its request (a
# connection closed unread is reset, and the answer may be lost) or after this; at
# most this many at a time linger so.
BUSY_LINGER_S = 0.5
BUSY_LINGERING = 100
# Request bodies (HTTP) being received at once, in bytes: at least two of the largest.
RECEIVING_BUDGET = 256 << 20
UPSTREAM_CONNECTIONS = 64  # to tritonserver's HTTP socket
# On SIGTERM the front refuses new requests as unavailable and answers those it holds
# (which tritonserver, still running, answers or refuses) within this; then it exits.
STOP_GRACE_S = 5.0
SHUTTING_DOWN = "the server is shutting down; send the request again, to another server"
# gRPC metadata passed on: how a stream reports errors (Triton's switch).
GRPC_METADATA = ("triton_grpc_error",)
# HTTP headers of tritonserver's answers passed on.
ANSWER_HEADERS = ("content-type", "content-encoding", "inference-header-content-length")


def _raise_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit; the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
            soft = max(soft, wanted)
        except (ValueError, OSError):
            pass
    return soft


_BUSY = b'{"error": "the server has all the connections it takes; try again later"}'
_BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY)
)


class _Busy(asyncio.Protocol):
    """A connection over the limit: told so (503) and closed, once its request is read
    (closed unread, the client may get a reset instead of the answer) or after
    BUSY_LINGER_S; at once where BUSY_LINGERING are already lingering."""

    lingering = 0

    def connection_made(self, transport) -> None:
        transport.write(_BUSY_ANSWER)
        self.counted = _Busy.lingering < BUSY_LINGERING
        if not self.counted:
            transport.close()
            return
        _Busy.lingering += 1
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(BUSY_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read

    def connection_lost(self, exc) -> None:
        if self.counted:
            _Busy.lingering -= 1
            self.timer.cancel()


class Front:
    def __init__(self, config: dict):
        self.config = config
        self.models = models_of(Path(config["repository"]), config.get("max_request_bytes"))
        self.shared_memory = bool(config.get("shared_memory"))
        self.shared_memory_header = config.get("shared_memory_header")  # (name, value)
        self.private_prefix = config.get("private_prefix", "")
        self.uid = os.getuid()
        limits = [model.limit for model in self.models.values()] or [0]
        self.body_limit = HEADER_ROOM + JSON_PER_BYTE * max(limits)
        self.message_limit = HEADER_ROOM + 2 * max(limits)
        self.receiving_budget = max(RECEIVING_BUDGET, 2 * self.body_limit)
        self.receiving = 0  # bytes of request bodies being received (reserved)
        files = _raise_file_limit()
        self.max_connections = max(16, min(MAX_CONNECTIONS, (files - SPARE_FILES) // 3))
        self.stopping = False  # set at SIGTERM: new requests are refused as unavailable
        self.in_flight = 0

    async def drain(self) -> None:
        """Refuse new requests, and return once those held are answered (or after the
        grace)."""
        self.stopping = True
        deadline = asyncio.get_running_loop().time() + STOP_GRACE_S
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    def shared_memory_refusal(self, peer: tuple[str, int] | None, port: int) -> str | None:
        """Why this connection may not use shared memory, or None."""
        if not self.shared_memory:
            return (
                "shared memory is off on this server (bladesmith serve --shared-memory "
                "turns it on, for the serving user)"
            )
        if peer is None or connection_owner(peer, port) != self.uid:
            return "shared memory is served to the serving user's own connections only"
        return None

    # HTTP

    async def serve_http(self):
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(
                path=self.config["http_socket"], limit=UPSTREAM_CONNECTIONS
            ),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent", "Content-Type"),
        )
        limit = self.max_connections

        class Bounded(web.Server):
            """At most ``limit`` connections: counted from their accepting (several are
            accepted before the first is made)."""

            starting = 0

            def __call__(self):
                if len(self.connections) + self.starting >= limit:
                    return _Busy()
                self.starting += 1
                return super().__call__()

            def connection_made(self, handler, transport) -> None:
                self.starting -= 1
                super().connection_made(handler, transport)

        # Bodies inflated here, within the limit (aiohttp's own inflating is bounded only
        # in its latest versions); no access log; a connection silent for IDLE_S closed.
        self.http = Bounded(
            self.handle_http,
            access_log=None,
            auto_decompress=False,
            keepalive_timeout=IDLE_S,
            lingering_time=1.0,
        )
        self.http_listener = await asyncio.get_running_loop().create_server(
            self.http, self.config["host"], self.config["http_port"], reuse_address=True
        )

    async def stop_http(self) -> None:
        self.http_listener.close()
        await self.http.shutdown(1.0)
        await self.session.close()

    async def handle_http(self, request):
        from aiohttp import web

        if self.stopping:
            return web.json_response({"error": SHUTTING_DOWN}, status=503)
        self.in_flight += 1
        try:
            return await self.forward_http(request)
        except Refused as refusal:
            return web.json_response({"error": str(refusal)}, status=refusal.status)
        finally:
            self.in_flight -= 1

    async def forward_http(self, request):
        from aiohttp import web

        route = http_route(request.raw_path, request.method, self.models)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if route.kind in ("shared", "shared-json", "register"):
            self._refuse_shared_memory(peer)
        limit = route.model.body_limit if route.kind == "infer" else HEADER_ROOM
        if request.method == "GET" or route.kind == "shared":
            limit = 0  # nothing to send (Triton reads no body there)
        declared = request.content_length
        if declared is not None and declared > limit:
            raise Refused(
                f"the request body is {declared} bytes, over the {limit} that this server "
                f"takes at {route.path}" + (" (--max-request-bytes)" if limit else "")
            )
        reserved = declared if declared is not None else limit
        if self.receiving + reserved > self.receiving_budget:
            raise Refused("the server is receiving all it takes at once; send again later", 429)
        self.receiving += reserved
        try:
            if limit and request.headers.get("Expect", "").lower() == "100-continue":
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits
            body = await _read(request, limit)
            body = _decompressed(body, request.headers.get("Content-Encoding", ""), limit)
            headers = {}
            if route.kind == "infer":
                body, headers = self._checked_infer(route.model, request, body, peer)
            elif route.kind in ("register", "shared-json"):
                region = strict_json(body, "the registration")
                if not isinstance(region, dict):
                    raise Refused("the registration is not a JSON object")
                if route.kind == "register":
                    check_keys(region, ("key", "offset", "byte_size"), "the registration")
                    check_region(
                        region.get("key"),
                        region.get("offset", 0),
                        region.get("byte_size"),
                        self.uid,
                        self.private_prefix,
                    )
                body = json.dumps(region).encode()
            if route.kind in ("shared", "shared-json", "register"):
                name, value = self.shared_memory_header
                headers[name] = value
            headers["Accept-Encoding"] = answer_encoding(request.headers.get("Accept-Encoding"))
        finally:
            self.receiving -= reserved
        try:
            async with self.session.request(
                request.method, f"http://triton{route.path}", data=body, headers=headers
            ) as upstream:
                answer = await upstream.read()
                kept = {
                    key: value
                    for key, value in upstream.headers.items()
                    if key.lower() in ANSWER_HEADERS
                }
                return web.Response(status=upstream.status, body=answer, headers=kept)
        except OSError as error:  # aiohttp's connection errors are OSErrors
            return web.json_response(
                {"error": f"the server is not answering ({error}): it may be stopping"},
                status=503,
            )

    def _refuse_shared_memory(self, peer) -> None:
        refusal = self.shared_memory_refusal(peer, self.config["http_port"])
        if refusal:
            raise Refused(refusal)

    def _checked_infer(self, model: Model, request, body: bytes, peer) -> tuple[bytes, dict]:
        """The inference request ``body`` re-encoded from what was checked, and its
        headers; Refused where it is not one for ``model``."""
        text = request.headers.get("Inference-Header-Content-Length")
        header_length = len(body)
        if text is not None:
            if not re.fullmatch(r"[0-9]{1,18}", text) or int(text) > len(body):
                raise Refused(
                    f"Inference-Header-Content-Length {text[:40]!r} is not a size within "
                    f"the body's {len(body)} bytes"
                )
            header_length = int(text)
        header = strict_json(body[:header_length], "the request")
        if check_http_infer(model, header, len(body) - header_length):
            self._refuse_shared_memory(peer)
        header, binary = as_binary(header, body[header_length:])
        checked = json.dumps(header, separators=(",", ":")).encode()
        if not binary:
            return checked, {}
        return checked + binary, {"Inference-Header-Content-Length": str(len(checked))}

    # gRPC

    async def serve_grpc(self):
        import grpc
        from google.protobuf import message_factory
        from tritonclient.grpc import service_pb2

        self.channel = grpc.aio.insecure_channel(
            f"unix:{self.config['grpc_socket']}",
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        handlers = {}
        for method in service.methods:
            kind = GRPC_METHODS.get(method.name)
            if kind is None:
                continue  # answered UNIMPLEMENTED by gRPC itself
            path = f"/{service.full_name}/{method.name}"
            kind_of = message_factory.GetMessageClass(method.input_type)
            if method.client_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                    self._stream(path, kind_of)
                )
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(path, method.name, kind, kind_of)
                )
        idle_ms = int(IDLE_S * 1000)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.message_limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.max_connection_idle_ms", idle_ms),
                ("grpc.server_handshake_timeout_ms", idle_ms),
                ("grpc.max_concurrent_streams", 100),
                ("grpc.max_connection_age_ms", int(GRPC_CONNECTION_S * 1000)),
                ("grpc.max_connection_age_grace_ms", int(GRPC_GRACE_S * 1000)),
            ],
            maximum_concurrent_rpcs=max(32, min(1024, self.receiving_budget // self.message_limit)),
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service.full_name, handlers)]
        )
        host = self.config["host"]
        where = f"[{host}]" if ":" in host else host
        server.add_insecure_port(f"{where}:{self.config['grpc_port']}")
        await server.start()
        return server

    def _check_grpc(self, name: str, kind: str, message: bytes, request_of, context) -> bytes:
        """The message of a gRPC call to ``name`` re-encoded from what was checked;
        Refused unless it may go on."""
        from google.protobuf.message import DecodeError

        try:
            request = request_of.FromString(message)
        except DecodeError as error:
            raise Refused(f"not a {request_of.DESCRIPTOR.name}: {error}") from None
        request.DiscardUnknownFields()
        shared = kind in ("shared", "register")
        if kind in ("model", "statistics"):
            if request.name or kind == "model":
                self._served(request.name)
            if request.version and not re.fullmatch(r"[1-9][0-9]{0,17}", request.version):
                raise Refused(f"version {request.version[:40]!r}: a version is a number")
        elif kind == "infer":
            shared = check_grpc_infer(self._served(request.model_name), request)
            if request.model_version and not re.fullmatch(
                r"[1-9][0-9]{0,17}", request.model_version
            ):
                raise Refused(f"version {request.model_version[:40]!r}: a version is a number")
        if shared:
            refusal = self.shared_memory_refusal(
                _grpc_peer(context.peer()), self.config["grpc_port"]
            )
            if refusal:
                raise Refused(refusal)
        if kind == "register":
            check_region(
                request.key, request.offset, request.byte_size, self.uid, self.private_prefix
            )
        return request.SerializeToString()

    def _served(self, name: str) -> Model:
        if name not in self.models:
            raise Refused(
                f"model {name[:100]!r}: not served here (serving {served_names(self.models)})", 404
            )
        return self.models[name]

    def _metadata(self, context, kind: str) -> tuple:
        kept = tuple(
            (key, value)
            for key, value in (context.invocation_metadata() or ())
            if key in GRPC_METADATA
        )
        if kind in ("shared", "register"):
            name, value = self.shared_memory_header
            kept += ((f"triton-grpc-protocol-{name}", value),)
        return kept

    def _unary(self, path: str, name: str, kind: str, request_of):
        import grpc

        call = self.channel.unary_unary(path)

        async def forward(message: bytes, context):
            if self.stopping:
                await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            self.in_flight += 1
            try:
                return await checked_forward(message, context)
            finally:
                self.in_flight -= 1

        async def checked_forward(message: bytes, context):
            try:
                message = self._check_grpc(name, kind, message, request_of, context)
            except Refused as refusal:
                await context.abort(_grpc_code(refusal.status), str(refusal))
            try:
                return await call(
                    message,
                    metadata=self._metadata(context, kind),
                    timeout=context.time_remaining(),
                )
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")

        return forward

    def _stream(self, path: str, request_of):
        import grpc

        call = self.channel.stream_stream(path)

        async def forward(messages, context):
            refusal = []

            async def checked():
                async for message in messages:
                    try:
                        yield self._check_grpc(
                            "ModelStreamInfer", "infer", message, request_of, context
                        )
                    except Refused as refused:
                        refusal.append(refused)
                        return

            try:
                async for answer in call(checked(), metadata=self._metadata(context, "infer")):
                    yield answer
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
            if refusal:
                await context.abort(_grpc_code(refusal[0].status), str(refusal[0]))

        return forward


def _grpc_code(status: int):
    """The gRPC status code of a refusal's HTTP status."""
    import grpc

    codes = {404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 429: "RESOURCE_EXHAUSTED"}
    return grpc.StatusCode[codes.get(status, "INVALID_ARGUMENT")]


async def _read(request, limit: int) -> bytes:
    """At most ``limit`` bytes of the body, all of it or Refused."""
    from aiohttp.http_exceptions import HttpProcessingError

    chunks, size = [], 0
    deadline = time.monotonic() + BODY_S
    try:
        while chunk := await asyncio.wait_for(request.content.readany(), BODY_IDLE_S):
            size += len(chunk)
            if size > limit:
                raise Refused(f"the request body is over the {limit} bytes this server takes")
            if time.monotonic() > deadline:
                raise Refused(f"the request body took over {BODY_S:.0f} s to come", 408)
            chunks.append(chunk)
    except (HttpProcessingError, ConnectionError) as error:
        raise Refused(f"the request body is cut short or malformed: {error}") from None
    except asyncio.TimeoutError:
        raise Refused(
            f"the request body stopped coming ({size} bytes in, none for {BODY_IDLE_S:.0f} s)",
            408,
        ) from None
    return b"".join(chunks)


def _decompressed(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` as sent before its Content-Encoding (gzip, deflate), at most ``limit``
    bytes of it (a small body may inflate to gigabytes)."""
    if not encoding or encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise Refused(f"Content-Encoding {encoding[:40]!r}: this server takes gzip or deflate")
    inflate = zlib.decompressobj(zlib.MAX_WBITS | (16 if encoding == "gzip" else 0))
    try:
        plain = inflate.decompress(body, limit + 1)
    except zlib.error as error:
        raise Refused(f"the body is not {encoding}: {error}") from None
    if len(plain) > limit or inflate.unconsumed_tail:
        raise Refused(f"the body inflates to over the {limit} bytes this server takes")
    return plain


def _grpc_peer(peer: str) -> tuple[str, int] | None:
    """gRPC's peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``) as (host, port)."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _OneLineErrors:
    """The event loop's error reports as one line each, at most one a second (a flood
    of failing accepts would otherwise fill the log with tracebacks)."""

    def __init__(self):
        self.last = 0.0
        self.dropped = 0

    def __call__(self, loop, context: dict) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            self.dropped += 1
            return
        error = context.get("exception")
        said = context.get("message", "")
        if error is not None:
            said = f"{said}: {type(error).__name__}: {error}"
        more = f" ({self.dropped} more not shown)" if self.dropped else ""
        print(f"bladesmith serve: request front: {said}{more}", file=sys.stderr, flush=True)
        self.last, self.dropped = now, 0


async def _main(config: dict) -> None:
    import logging

    # aiohttp logs each malformed request with a traceback; the client has its 400.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    front = Front(config)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_OneLineErrors())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    await front.serve_http()
    grpc_server = await front.serve_grpc()
    print(
        f"bladesmith serve: request front on {config['host']}: http {config['http_port']}, "
        f"grpc {config['grpc_port']} (at most {front.max_connections} connections each)",
        file=sys.stderr,
        flush=True,
    )
    await stopped.wait()
    await front.drain()
    await asyncio.gather(grpc_server.stop(0), front.stop_http())


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    asyncio.run(_main(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
