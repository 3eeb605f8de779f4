"""The request front of ``bladesmith serve``: the only door to its tritonserver.

tritonserver listens on Unix sockets in the server's own folder (mode 0700: the serving
user's alone); this process listens on the HTTP and gRPC ports and hands each request on
unchanged once it has checked it, because Triton 2.51 cannot be told to:

- An inference request names the model's inputs, each in its dtype and shape with a
  batch up to the model's, and declares at most the model's limit of tensor bytes (its
  signature times its max batch, or ``--max-request-bytes``); its body holds what it
  declares. Triton allocates what an HTTP/JSON request declares before it reads the
  data: a request of 100 bytes declaring 16 GiB ended it. A body larger than the limit
  allows is refused from its Content-Length (or the gRPC message's length), unread.
  Refused: HTTP 400 / gRPC INVALID_ARGUMENT, with one line.
- Shared memory (registering regions, their status, requests naming them) is refused
  unless the server was started with ``--shared-memory``, and then served only to
  connections of the serving user: their owner is read from the kernel's socket table
  (``/proc/net/tcp``), so a connection from another user or another machine is refused.
  A system region registered must be a file of /dev/shm that is the serving user's
  alone (owner, mode 0600) and holds the bytes named (Triton would open anything the
  serving user can, and answer 500 for what it cannot).
- The trace and log settings cannot be changed through the API (any client could).

Run as a script (``python front.py CONFIG``, which ``Server`` does), it imports neither
torch nor bladesmith. CONFIG (JSON) names the ports, the sockets, the repository whose
``config.pbtxt`` files give the models' inputs, the limit and whether shared memory is
served.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import re
import signal
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

# Bytes per element; BYTES elements hold at least one byte each.
ITEM_BYTES = {
    "BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2,
    "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8, "BYTES": 1,
}  # fmt: skip
# A model whose config leaves a size free (-1) has no limit of its own: this one.
UNBOUNDED_LIMIT = 64 << 20
# Room for a request's JSON header; JSON text holds a number in at most this many times
# its bytes ("-1.2345678901234567e-308,": 25 characters for a float64's 8 bytes).
HEADER_ROOM = 64 << 10
JSON_PER_BYTE = 32
# A body that stops coming for this long is refused (408): a client that sent less than
# its Content-Length would otherwise hold its connection, and the memory read, forever.
BODY_IDLE_S = 10.0
# On SIGTERM the front refuses new requests as unavailable and answers those it holds
# (which tritonserver, still running, answers or refuses) within this; then it exits.
STOP_GRACE_S = 5.0
SHUTTING_DOWN = "the server is shutting down; send the request again, to another server"
# Where a request names a shared-memory region.
SHARED_MEMORY_PARAMETER = "shared_memory_region"
# gRPC methods that only the serving user may call, and only with --shared-memory.
SHARED_MEMORY_METHODS = (
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
)  # fmt: skip
SETTINGS_METHODS = ("TraceSetting", "LogSettings")
_HOP_BY_HOP = {
    "connection", "keep-alive", "transfer-encoding", "content-length", "host", "expect",
    "te", "trailer", "upgrade", "proxy-connection",
}  # fmt: skip
_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/infer$")
_SHARED_MEMORY_PATH = re.compile(r"^/v2/(system|cuda)sharedmemory(/|$)")
_REGISTER_PATH = re.compile(r"^/v2/systemsharedmemory/region/[^/]+/register$")
_SETTINGS_PATH = re.compile(r"^/v2/(models/[^/]+/)?(trace/setting|logging)$")


class Refused(Exception):
    """A request refused for what it is (the client's error): one line, and the HTTP
    status (400 unless said)."""

    def __init__(self, reason: str, status: int = 400):
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Model:
    name: str
    max_batch: int  # 0: the shapes are whole (no batch dimension)
    inputs: dict[str, tuple[str, tuple[int, ...], bool]]  # name: (datatype, dims, optional)
    limit: int  # tensor bytes a request may declare

    def check(self, inputs: list[tuple[object, object, object]]) -> list[int]:
        """Refused unless ``inputs`` ((name, datatype, shape) as the request has them) are
        this model's; each one's declared tensor bytes."""
        sizes, seen = [], set()
        for name, datatype, shape in inputs:
            if not isinstance(name, str) or name not in self.inputs:
                raise Refused(
                    f"{self.name} has no input {name!r} (it takes {', '.join(self.inputs)})"
                )
            if name in seen:
                raise Refused(f"input {name!r} is given twice")
            seen.add(name)
            wanted = self.inputs[name][0]
            if datatype != wanted:
                raise Refused(f"input {name!r}: expected datatype {wanted}, got {datatype!r}")
            if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
                raise Refused(f"input {name!r}: shape {shape!r} is not a list of sizes >= 0")
            sizes.append(math.prod(shape) * ITEM_BYTES[datatype])
        if sum(sizes) > self.limit:
            raise Refused(
                f"{self.name}: the request declares {sum(sizes)} bytes of inputs, over this "
                f"server's limit of {self.limit} (--max-request-bytes)"
            )
        for name, _, shape in inputs:
            self._check_shape(name, shape)
        missing = [name for name, (_, _, optional) in self.inputs.items() if not optional]
        missing = [name for name in missing if name not in seen]
        if missing:
            raise Refused(f"{self.name}: input {missing[0]!r} is missing")
        batches = {shape[0] for _, _, shape in inputs} if self.max_batch else set()
        if len(batches) > 1:
            raise Refused(f"{self.name}: the inputs disagree on the batch size: {sorted(batches)}")
        return sizes

    def _check_shape(self, name: str, shape: list[int]) -> None:
        dims = self.inputs[name][1]
        want = ("N", *dims) if self.max_batch else dims
        fits = len(shape) == len(want) and all(
            w == "N" or w < 0 or s == w for s, w in zip(shape, want)
        )
        if not fits:
            said = ", ".join("any" if isinstance(w, int) and w < 0 else str(w) for w in want)
            raise Refused(f"input {name!r}: expected shape [{said}], got {shape}")
        if self.max_batch and not 1 <= shape[0] <= self.max_batch:
            raise Refused(
                f"input {name!r}: a batch of {shape[0]} rows; this model takes 1 to "
                f"{self.max_batch}"
            )

    @property
    def body_limit(self) -> int:
        """The most bytes an HTTP request body to this model may hold (JSON text)."""
        return HEADER_ROOM + JSON_PER_BYTE * self.limit


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def models_of(repository: Path, max_request_bytes: int | None) -> dict[str, Model]:
    """The models of a repository, from their ``config.pbtxt`` (Triton's own schema)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as schema

    models = {}
    for config_file in sorted(repository.glob("*/config.pbtxt")):
        config = text_format.Parse(config_file.read_text(), schema.ModelConfig())
        name = config.name or config_file.parent.name
        inputs = {
            tensor.name: (
                schema.DataType.Name(tensor.data_type)
                .removeprefix("TYPE_")
                .replace("STRING", "BYTES"),
                tuple(tensor.dims),
                tensor.optional,
            )
            for tensor in config.input
        }
        batch = max(config.max_batch_size, 1)
        own = sum(
            math.prod(dims) * ITEM_BYTES[datatype] * batch for datatype, dims, _ in inputs.values()
        )
        free = any(d < 0 for _, dims, _ in inputs.values() for d in dims)
        limit = max_request_bytes or (UNBOUNDED_LIMIT if free else own)
        models[name] = Model(name, config.max_batch_size, inputs, limit)
    return models


def check_json_data(name: str, datatype: str, shape: list[int], data) -> None:
    """Refused unless JSON ``data`` (nested lists) holds as many values as ``shape``, each
    of ``datatype``'s kind."""
    kind = (str,) if datatype == "BYTES" else (bool,) if datatype == "BOOL" else (int, float)
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, kind) and (datatype == "BOOL" or not isinstance(item, bool)):
            count += 1
        else:
            raise Refused(f"input {name!r}: data holds {item!r}, not a {datatype} value")
    if count != math.prod(shape):
        raise Refused(
            f"input {name!r}: data holds {count} values; shape {shape} declares {math.prod(shape)}"
        )


def check_http_infer(model: Model, header: dict, binary: int) -> bool:
    """Refused unless an HTTP inference request's JSON ``header`` is one for ``model``
    whose ``binary`` bytes after it hold what it declares; whether it names shared
    memory."""
    if not isinstance(header, dict):
        raise Refused("the request is not a JSON object")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, dict) for t in inputs):
        raise Refused('the request has no "inputs" (a list of tensors)')
    outputs = header.get("outputs", [])
    if not isinstance(outputs, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in outputs
    ):
        raise Refused('"outputs" is not a list of tensors with names')
    for part in (header, *inputs, *outputs):
        if not isinstance(part.get("parameters", {}), dict):
            raise Refused('"parameters" is not a JSON object')
    if "id" in header and not isinstance(header["id"], str):
        raise Refused('"id" is not a string')
    sizes = model.check([(t.get("name"), t.get("datatype"), t.get("shape")) for t in inputs])
    shared, sent = False, 0
    for tensor, size in zip(inputs, sizes):
        name, parameters = tensor["name"], tensor.get("parameters", {})
        given = [key for key in ("data", "binary_data_size", SHARED_MEMORY_PARAMETER)
                 if key in tensor or key in parameters]  # fmt: skip
        if len(given) != 1:
            raise Refused(
                f"input {name!r}: give one of data, binary_data_size or shared_memory_region"
            )
        if "data" in tensor:
            check_json_data(name, tensor["datatype"], tensor["shape"], tensor["data"])
        elif "binary_data_size" in parameters:
            declared = parameters["binary_data_size"]
            if not _is_size(declared) or (tensor["datatype"] != "BYTES" and declared != size):
                raise Refused(
                    f"input {name!r}: binary_data_size {declared!r}, but shape "
                    f"{tensor['shape']} of {tensor['datatype']} holds {size} bytes"
                )
            if tensor["datatype"] == "BYTES" and size > declared:
                raise Refused(f"input {name!r}: {size} strings cannot fit {declared} bytes")
            sent += declared
        else:
            shared = True
    shared = shared or any(SHARED_MEMORY_PARAMETER in t.get("parameters", {}) for t in outputs)
    if sent != binary:
        raise Refused(f"the request's binary data is {binary} bytes; its inputs declare {sent}")
    return shared


def check_grpc_infer(models: dict[str, Model], request) -> bool:
    """Refused unless a gRPC ModelInferRequest is one for its model (where this server
    has it) whose contents hold what it declares; whether it names shared memory."""
    shared = any(SHARED_MEMORY_PARAMETER in t.parameters for t in request.inputs) or any(
        SHARED_MEMORY_PARAMETER in t.parameters for t in request.outputs
    )
    model = models.get(request.model_name)
    if model is None:
        return shared  # Triton says it has no such model
    inputs = [(t.name, t.datatype, list(t.shape)) for t in request.inputs]
    if not inputs:
        raise Refused(f"{model.name}: the request has no inputs")
    sizes = model.check(inputs)
    raw = request.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise Refused(f"the request has {len(raw)} raw input contents for {len(inputs)} inputs")
    for k, (tensor, size) in enumerate(zip(request.inputs, sizes)):
        if raw:
            if tensor.datatype != "BYTES" and len(raw[k]) != size:
                raise Refused(
                    f"input {tensor.name!r}: {len(raw[k])} bytes of raw contents; shape "
                    f"{list(tensor.shape)} of {tensor.datatype} holds {size}"
                )
        elif tensor.HasField("contents"):
            field = tensor.contents.ListFields()
            count = len(field[0][1]) if field else 0
            if count != math.prod(tensor.shape):
                raise Refused(
                    f"input {tensor.name!r}: {count} values; shape {list(tensor.shape)} "
                    f"declares {math.prod(tensor.shape)}"
                )
        elif SHARED_MEMORY_PARAMETER not in tensor.parameters:
            raise Refused(f"input {tensor.name!r} has no contents")
    return shared


def check_region(key, offset, byte_size, uid: int) -> None:
    """Refused unless ``key`` names a system shared-memory region (/dev/shm/NAME) that is
    user ``uid``'s alone and holds ``byte_size`` bytes from ``offset``."""
    if not isinstance(key, str) or not re.fullmatch(r"/[^/\0]+", key) or key in ("/.", "/.."):
        raise Refused(f"key {key!r}: a shared-memory key is /NAME, a region in /dev/shm")
    try:
        found = (Path("/dev/shm") / key[1:]).lstat()  # a link is not followed
    except OSError:
        raise Refused(f"key {key!r}: there is no such shared-memory region") from None
    if not stat.S_ISREG(found.st_mode) or found.st_uid != uid or found.st_mode & 0o077:
        raise Refused(
            f"key {key!r}: the region is not the serving user's alone (owner "
            f"{found.st_uid}, mode {found.st_mode & 0o777:o}): make it with mode 0600"
        )
    if not (_is_size(offset) and _is_size(byte_size)) or offset + byte_size > found.st_size:
        raise Refused(
            f"key {key!r}: offset {offset!r} and byte_size {byte_size!r} are not within "
            f"its {found.st_size} bytes"
        )


def connection_owner(peer: tuple[str, int], local_port: int) -> int | None:
    """The user id owning the other end of a TCP connection from ``peer`` to our
    ``local_port``, where it is a socket of this machine (the kernel's table lists it);
    else None."""
    try:
        host = ipaddress.ip_address(peer[0].split("%")[0])
    except ValueError:
        return None
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped:
        host = host.ipv4_mapped
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            (address, port), (_, remote_port) = (f.split(":") for f in fields[1:3])
            if int(port, 16) == peer[1] and int(remote_port, 16) == local_port:
                if _table_address(address) == host:
                    return int(fields[7])
    return None


def _table_address(text: str):
    """An address as /proc/net/tcp writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


class Front:
    def __init__(self, config: dict):
        self.config = config
        self.models = models_of(Path(config["repository"]), config.get("max_request_bytes"))
        self.shared_memory = bool(config.get("shared_memory"))
        self.uid = os.getuid()
        limits = [model.limit for model in self.models.values()] or [0]
        self.body_limit = HEADER_ROOM + JSON_PER_BYTE * max(limits)
        self.message_limit = HEADER_ROOM + 2 * max(limits)
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
            connector=aiohttp.UnixConnector(path=self.config["http_socket"]),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        app = web.Application(client_max_size=self.body_limit + 1)
        app.router.add_route("*", "/{path:.*}", self.handle_http)
        # Bodies inflated here, within the limit (aiohttp's own inflating is bounded only
        # in its latest versions).
        runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await runner.setup()
        site = web.TCPSite(
            runner, self.config["host"], self.config["http_port"], reuse_address=True
        )
        await site.start()
        return runner

    async def handle_http(self, request):
        from aiohttp import web

        if self.stopping:
            return web.json_response({"error": SHUTTING_DOWN}, status=503)
        self.in_flight += 1
        try:
            return await self.forward_http(request)
        finally:
            self.in_flight -= 1

    async def forward_http(self, request):
        from aiohttp import web

        try:
            body = await self.checked_body(request)
        except Refused as refusal:
            return web.json_response({"error": str(refusal)}, status=refusal.status)
        headers = {
            key: value
            for key, value in request.headers.items()
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-encoding"
        }
        try:
            async with self.session.request(
                request.method, f"http://triton{request.rel_url}", data=body, headers=headers
            ) as upstream:
                answer = await upstream.read()
                kept = {
                    key: value
                    for key, value in upstream.headers.items()
                    if key.lower() not in _HOP_BY_HOP
                }
                return web.Response(status=upstream.status, body=answer, headers=kept)
        except OSError as error:  # aiohttp's connection errors are OSErrors
            return web.json_response(
                {"error": f"the server is not answering ({error}): it may be stopping"},
                status=503,
            )

    async def checked_body(self, request) -> bytes:
        """The request's body (decompressed) once checked; Refused otherwise."""
        path = request.path
        infer = _INFER.match(path)
        model = self.models.get(infer.group(1)) if infer else None
        if _SETTINGS_PATH.match(path) and request.method != "GET":
            raise Refused(f"{path}: this server's trace and log settings cannot be changed")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if _SHARED_MEMORY_PATH.match(path):
            refusal = self.shared_memory_refusal(peer, self.config["http_port"])
            if refusal:
                raise Refused(refusal)
        limit = model.body_limit if model else HEADER_ROOM
        if request.content_length is not None and request.content_length > limit:
            raise Refused(
                f"the request body is {request.content_length} bytes, over the {limit} that "
                f"this server takes at {path} (--max-request-bytes)"
            )
        body = await _read(request, limit)
        body = _decompressed(body, request.headers.get("Content-Encoding", ""), limit)
        if _REGISTER_PATH.match(path) and request.method == "POST":
            region = _json(body)
            if not isinstance(region, dict):
                raise Refused("the registration is not a JSON object")
            check_region(
                region.get("key"), region.get("offset", 0), region.get("byte_size"), self.uid
            )
        if model is not None and request.method == "POST":
            text = request.headers.get("Inference-Header-Content-Length")
            header_length = len(body)
            if text is not None:
                if not text.isdigit() or int(text) > len(body):
                    raise Refused(
                        f"Inference-Header-Content-Length {text!r} is not a size within the "
                        f"body's {len(body)} bytes"
                    )
                header_length = int(text)
            header = _json(body[:header_length])
            if check_http_infer(model, header, len(body) - header_length):
                refusal = self.shared_memory_refusal(peer, self.config["http_port"])
                if refusal:
                    raise Refused(refusal)
        return body

    # gRPC

    async def serve_grpc(self):
        import grpc
        from tritonclient.grpc import service_pb2

        self.channel = grpc.aio.insecure_channel(
            f"unix:{self.config['grpc_socket']}",
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        self.requests = {
            "ModelInfer": service_pb2.ModelInferRequest,
            "ModelStreamInfer": service_pb2.ModelInferRequest,
            "SystemSharedMemoryRegister": service_pb2.SystemSharedMemoryRegisterRequest,
        }
        handlers = {}
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            if method.client_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(self._stream(path))
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(path, method.name)
                )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.message_limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service.full_name, handlers)]
        )
        host = self.config["host"]
        where = f"[{host}]" if ":" in host else host
        server.add_insecure_port(f"{where}:{self.config['grpc_port']}")
        await server.start()
        return server

    def _check_grpc(self, name: str, message: bytes, context) -> None:
        """Refused unless a gRPC call to ``name`` with ``message`` may go on."""
        from google.protobuf.message import DecodeError

        if name in SETTINGS_METHODS:
            raise Refused(f"{name}: this server's trace and log settings cannot be changed")
        shared = name in SHARED_MEMORY_METHODS
        kind = self.requests.get(name)
        try:
            request = kind.FromString(message) if kind else None
        except DecodeError as error:
            raise Refused(f"not a {kind.DESCRIPTOR.name}: {error}") from None
        if name in ("ModelInfer", "ModelStreamInfer"):
            shared = check_grpc_infer(self.models, request) or shared
        if shared:
            refusal = self.shared_memory_refusal(
                _grpc_peer(context.peer()), self.config["grpc_port"]
            )
            if refusal:
                raise Refused(refusal)
        if name == "SystemSharedMemoryRegister":
            check_region(request.key, request.offset, request.byte_size, self.uid)

    def _unary(self, path: str, name: str):
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
                self._check_grpc(name, message, context)
            except Refused as refusal:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(refusal))
            try:
                return await call(
                    message, metadata=_metadata(context), timeout=context.time_remaining()
                )
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")

        return forward

    def _stream(self, path: str):
        import grpc

        call = self.channel.stream_stream(path)

        async def forward(messages, context):
            refusal = []

            async def checked():
                async for message in messages:
                    try:
                        self._check_grpc("ModelStreamInfer", message, context)
                    except Refused as refused:
                        refusal.append(str(refused))
                        return
                    yield message

            try:
                async for answer in call(checked(), metadata=_metadata(context)):
                    yield answer
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
            if refusal:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal[0])

        return forward


def _json(text: bytes):
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise Refused(f"the request is not JSON: {error}") from None


async def _read(request, limit: int) -> bytes:
    """At most ``limit`` bytes of the body, all of it or Refused."""
    from aiohttp.http_exceptions import HttpProcessingError

    chunks, size = [], 0
    try:
        while chunk := await asyncio.wait_for(request.content.readany(), BODY_IDLE_S):
            size += len(chunk)
            if size > limit:
                raise Refused(f"the request body is over the {limit} bytes this server takes")
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
        raise Refused(f"Content-Encoding {encoding!r}: this server takes gzip or deflate")
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


def _metadata(context) -> tuple:
    return tuple(
        (key, value)
        for key, value in (context.invocation_metadata() or ())
        if not key.startswith((":", "grpc-")) and key not in ("user-agent", "te", "content-type")
    )


async def _main(config: dict) -> None:
    import logging

    # aiohttp logs each malformed request with a traceback; the client has its 400.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    front = Front(config)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    http = await front.serve_http()
    grpc_server = await front.serve_grpc()
    print(
        f"bladesmith serve: request front on {config['host']}: http {config['http_port']}, "
        f"grpc {config['grpc_port']}",
        file=sys.stderr,
        flush=True,
    )
    await stopped.wait()
    await front.drain()
    await asyncio.gather(grpc_server.stop(0), http.cleanup())
    await front.session.close()


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    asyncio.run(_main(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
