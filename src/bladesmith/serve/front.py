"""The request front of ``bladesmith serve``: the only door to its tritonserver.

tritonserver listens on Unix sockets in the server's own folder (mode 0700: the serving
user's alone); this process listens on the HTTP and gRPC ports. It is an allowlist, not
a filter: it forwards the routes it knows, each rebuilt from what it checked, and
answers everything else itself.

- Routes. HTTP: health (live, ready), server and model metadata, model ready, config
  and statistics, inference of the served models; gRPC: the same methods. The path is
  read as sent and must already be canonical: segments of letters, digits, ``_``, ``-``
  and ``.`` (not first), no ``%``, ``//``, ``.``/``..`` segment, trailing ``/`` or
  query (else 400); an unknown path is 404, a known one with another method 405, an
  unknown gRPC method UNIMPLEMENTED, a model this server does not serve 404 / NOT_FOUND.
  tritonserver's generate, logging, trace and repository APIs are never reached.
- Inference. The request (JSON header: strict, no key twice, no NaN; gRPC: protobuf)
  names the model's inputs, each in its dtype and shape with a batch up to the model's,
  its outputs by name and known parameters only, and declares at most the model's
  limit of tensor bytes (its signature times its max batch, or ``--max-request-bytes``);
  its body holds what it declares. tritonserver receives the request as the front
  re-encodes it from what it checked (so both read the same request; JSON tensor data
  as binary data), never the bytes sent. Triton 2.51 allocates what an HTTP/JSON
  request declares before it reads the data (100 bytes declaring 16 GiB ended it) and
  has no input-size limit of its own.
- Shared memory (registering regions, their status, requests naming them) is refused
  unless the server was started with ``--shared-memory``, and then served only to
  connections of the serving user: their owner is read from the kernel's socket table
  (``/proc/net/tcp``). A system region registered must be a file of /dev/shm that is the
  serving user's alone (owner, mode 0600), holds the bytes named and is not one of the
  Python backend's own.
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
torch nor bladesmith. CONFIG (JSON) names the ports, the sockets, the repository whose
``config.pbtxt`` files give the models' inputs and outputs, the limit, whether shared
memory is served, the header that opens it and the Python backend's region prefix.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import re
import resource
import signal
import stat
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

# Bytes per element; BYTES elements hold at least one byte each.
ITEM_BYTES = {
    "BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2,
    "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8, "BYTES": 1,
}  # fmt: skip
# The values each integer datatype holds: [low, high].
INT_RANGES = {
    **{f"INT{bits}": (-(1 << bits - 1), (1 << bits - 1) - 1) for bits in (8, 16, 32, 64)},
    **{f"UINT{bits}": (0, (1 << bits) - 1) for bits in (8, 16, 32, 64)},
}
FLOAT_MAX = sys.float_info.max
# The datatypes whose JSON values the front sends on as binary data (little-endian, as
# Triton's binary extension takes them).
NUMPY_TYPES = {
    "BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}  # fmt: skip
# A model whose config leaves a size free (-1) has no limit of its own: this one.
UNBOUNDED_LIMIT = 64 << 20
# Room for a request's JSON header; JSON text holds a number in at most this many times
# its bytes ("-1.2345678901234567e-308,": 25 characters for a float64's 8 bytes).
HEADER_ROOM = 64 << 10
JSON_PER_BYTE = 32
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
# Where a request names a shared-memory region.
SHARED_MEMORY_PARAMETERS = (
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
)
# The parameters a request may carry (Triton's; others are refused), and their kinds.
REQUEST_PARAMETERS = {"binary_data_output": bool, "priority": int, "timeout": int}
INPUT_PARAMETERS = {"binary_data_size": int, "shared_memory_region": str,
                    "shared_memory_byte_size": int, "shared_memory_offset": int}  # fmt: skip
OUTPUT_PARAMETERS = {"binary_data": bool, "classification": int, "shared_memory_region": str,
                     "shared_memory_byte_size": int, "shared_memory_offset": int}  # fmt: skip
LARGEST_PARAMETER = (1 << 63) - 1
MAX_ID = 256  # characters of a request's id
# gRPC metadata passed on: how a stream reports errors (Triton's switch).
GRPC_METADATA = ("triton_grpc_error",)

# A model, version or region name as it may appear in a path (Triton's model names are
# these; see repository.check_model_name).
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_CANONICAL = re.compile(r"(?:/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}){1,8}")
_MODEL = rf"/v2/models/(?P<model>{_NAME})(?:/versions/(?P<version>[1-9][0-9]{{0,17}}))?"
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
        (rf"{_SHARED}(?:/region/{_NAME})?/status", "GET", "shared"),
        (rf"{_SHARED}(?:/region/{_NAME})?/unregister", "POST", "shared"),
        (rf"/v2/systemsharedmemory/region/{_NAME}/register", "POST", "register"),
        (rf"/v2/cudasharedmemory/region/{_NAME}/register", "POST", "shared-json"),
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
# HTTP headers of tritonserver's answers passed on.
ANSWER_HEADERS = ("content-type", "content-encoding", "inference-header-content-length")


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
    outputs: tuple[str, ...] = ()

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

    def check_outputs(self, names: list) -> None:
        """Refused unless ``names`` are this model's outputs, each once."""
        for name in names:
            if name not in self.outputs:
                raise Refused(
                    f"{self.name} has no output {name!r} (it gives {', '.join(self.outputs)})"
                )
        if len(set(names)) != len(names):
            raise Refused(f"{self.name}: an output is asked for twice")

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
        outputs = tuple(tensor.name for tensor in config.output)
        models[name] = Model(name, config.max_batch_size, inputs, limit, outputs)
    return models


def strict_json(text: bytes, what: str):
    """``text`` as JSON (UTF-8), refused where it is not strictly so: a key twice in an
    object (readers differ on which copy counts), NaN or Infinity, nesting deeper than
    the interpreter takes."""

    def pairs(items: list) -> dict:
        found = dict(items)
        if len(found) != len(items):
            twice = next(key for k, (key, _) in enumerate(items) if key in dict(items[:k]))
            raise Refused(f"{what}: key {twice!r} is given twice")
        return found

    def constant(name: str):
        raise Refused(f"{what}: {name} is not a JSON value")

    try:
        return json.loads(text.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError:
        raise Refused(f"{what}: nested too deep") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise Refused(f"{what} is not JSON: {error}") from None


def check_json_data(name: str, datatype: str, shape: list[int], data) -> None:
    """Refused unless JSON ``data`` (a list, its lists nested at most as deep as
    ``shape``) holds as many values as ``shape``, each a ``datatype`` value (integers
    within its range, finite floats, strings of UTF-8). Each list's values are checked
    together, at C speed: a request's data may hold millions."""
    if type(data) is not list:
        raise Refused(f"input {name!r}: data is not a list")
    deepest = max(len(shape), 1)
    count, stack = 0, [(data, 1)]
    while stack:
        values, depth = stack.pop()
        if depth > deepest:
            raise Refused(f"input {name!r}: data nested deeper than shape {shape}")
        kinds = set(map(type, values))
        if list in kinds:
            if kinds != {list}:
                raise Refused(f"input {name!r}: data mixes lists and values")
            stack.extend((value, depth + 1) for value in values)
            continue
        if values and not _are_values(datatype, values, kinds):
            raise Refused(f"input {name!r}: data holds values that are not {datatype} values")
        count += len(values)
    if count != math.prod(shape):
        raise Refused(
            f"input {name!r}: data holds {count} values; shape {shape} declares {math.prod(shape)}"
        )


def _are_values(datatype: str, values: list, kinds: set) -> bool:
    """Whether ``values`` (of the types ``kinds``, none a list) are ``datatype``'s."""
    if datatype == "BYTES":
        return kinds == {str} and _is_text("".join(values))
    if datatype == "BOOL":
        return kinds == {bool}
    if datatype in INT_RANGES:
        low, high = INT_RANGES[datatype]
        return kinds == {int} and low <= min(values) and max(values) <= high
    # A float, or an integer a float holds (infinity comes from 1e999; NaN is refused).
    return kinds <= {int, float} and -FLOAT_MAX <= min(values) and max(values) <= FLOAT_MAX


def as_binary(header: dict, binary: bytes) -> tuple[dict, bytes]:
    """A checked inference request (its JSON ``header`` and the ``binary`` data after
    it) with its inputs' JSON data sent as binary data instead, as Triton would read it
    (BF16 and BYTES kept as JSON): the header, and the binary data after it. Triton
    then parses no number, and the front writes none back as text (slow in Python)."""
    import numpy as np

    parts, offset, inputs = [], 0, []
    for tensor in header["inputs"]:
        parameters = tensor.get("parameters", {})
        if "binary_data_size" in parameters:
            size = parameters["binary_data_size"]
            parts.append(binary[offset : offset + size])
            offset += size
        elif "data" in tensor and tensor["datatype"] in NUMPY_TYPES:
            values = [value for leaf in _leaves(tensor["data"]) for value in leaf]
            parts.append(np.asarray(values, NUMPY_TYPES[tensor["datatype"]]).tobytes())
            tensor = {key: value for key, value in tensor.items() if key != "data"}
            tensor["parameters"] = {**parameters, "binary_data_size": len(parts[-1])}
        inputs.append(tensor)
    return {**header, "inputs": inputs}, b"".join(parts)


def _leaves(data: list) -> list[list]:
    """The lists of values in checked JSON ``data`` (lists of lists or of values), in
    order."""
    if not data or type(data[0]) is not list:
        return [data]
    return [leaf for item in data for leaf in _leaves(item)]


def _is_text(value) -> bool:
    """A string that UTF-8 can hold (JSON's escapes can write a lone surrogate)."""
    if type(value) is not str:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_parameters(parameters, allowed: dict, where: str) -> dict:
    """Refused unless ``parameters`` is a JSON object of ``allowed`` names and kinds."""
    if not isinstance(parameters, dict):
        raise Refused(f'{where}: "parameters" is not a JSON object')
    for key, value in parameters.items():
        kind = allowed.get(key)
        if kind is None:
            raise Refused(
                f"{where}: parameter {key!r} is not taken here (only {', '.join(allowed)})"
            )
        if kind is int:
            ok = _is_size(value) and value <= LARGEST_PARAMETER
        elif kind is str:
            ok = isinstance(value, str) and re.fullmatch(_NAME, value) is not None
        else:
            ok = type(value) is kind
        if not ok:
            raise Refused(f"{where}: parameter {key!r} is {value!r:.40}, not a {kind.__name__}")
    return parameters


def _check_keys(part: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [key for key in part if key not in allowed]
    if unknown:
        raise Refused(f"{where}: {unknown[0]!r} is not taken here (only {', '.join(allowed)})")


def check_http_infer(model: Model, header, binary: int) -> bool:
    """Refused unless an HTTP inference request's JSON ``header`` is one for ``model``
    whose ``binary`` bytes after it hold what it declares, and has only the keys and
    parameters Triton's protocol gives; whether it names shared memory."""
    if not isinstance(header, dict):
        raise Refused("the request is not a JSON object")
    _check_keys(header, ("id", "parameters", "inputs", "outputs"), "the request")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, dict) for t in inputs):
        raise Refused('the request has no "inputs" (a list of tensors)')
    outputs = header.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(t, dict) for t in outputs):
        raise Refused('"outputs" is not a list of tensors')
    if "id" in header and not (_is_text(header["id"]) and len(header["id"]) <= MAX_ID):
        raise Refused(f'"id" is not a string of at most {MAX_ID} characters')
    _check_parameters(header.get("parameters", {}), REQUEST_PARAMETERS, "the request")
    for tensor in inputs:
        _check_keys(tensor, ("name", "shape", "datatype", "parameters", "data"), "an input")
        _check_parameters(tensor.get("parameters", {}), INPUT_PARAMETERS, "an input")
    for tensor in outputs:
        _check_keys(tensor, ("name", "parameters"), "an output")
        _check_parameters(tensor.get("parameters", {}), OUTPUT_PARAMETERS, "an output")
    model.check_outputs([t.get("name") for t in outputs])
    sizes = model.check([(t.get("name"), t.get("datatype"), t.get("shape")) for t in inputs])
    shared, sent = False, 0
    for tensor, size in zip(inputs, sizes):
        name, parameters = tensor["name"], tensor.get("parameters", {})
        given = [key for key in ("data", "binary_data_size", "shared_memory_region")
                 if key in tensor or key in parameters]  # fmt: skip
        if len(given) != 1:
            raise Refused(
                f"input {name!r}: give one of data, binary_data_size or shared_memory_region"
            )
        if "data" in tensor:
            check_json_data(name, tensor["datatype"], tensor["shape"], tensor["data"])
        elif "binary_data_size" in parameters:
            declared = parameters["binary_data_size"]
            if tensor["datatype"] != "BYTES" and declared != size:
                raise Refused(
                    f"input {name!r}: binary_data_size {declared!r}, but shape "
                    f"{tensor['shape']} of {tensor['datatype']} holds {size} bytes"
                )
            if tensor["datatype"] == "BYTES" and size > declared:
                raise Refused(f"input {name!r}: {size} strings cannot fit {declared} bytes")
            sent += declared
        else:
            shared = True
    shared = shared or any(
        key in t.get("parameters", {}) for t in outputs for key in SHARED_MEMORY_PARAMETERS
    )
    if sent != binary:
        raise Refused(f"the request's binary data is {binary} bytes; its inputs declare {sent}")
    return shared


def _grpc_parameters(parameters, allowed: dict, where: str) -> None:
    """Refused unless gRPC ``parameters`` (a map of InferParameter) are ``allowed``."""
    for key, parameter in parameters.items():
        kind = allowed.get(key)
        given = parameter.WhichOneof("parameter_choice")
        value = getattr(parameter, given) if given else None
        if kind is None:
            raise Refused(
                f"{where}: parameter {key!r} is not taken here (only {', '.join(allowed)})"
            )
        if kind is int:
            ok = given in ("int64_param", "uint64_param") and 0 <= value <= LARGEST_PARAMETER
        elif kind is str:
            ok = given == "string_param" and re.fullmatch(_NAME, value) is not None
        else:
            ok = given == "bool_param"
        if not ok:
            raise Refused(f"{where}: parameter {key!r} is not a {kind.__name__}")


def check_grpc_infer(model: Model, request) -> bool:
    """Refused unless a gRPC ModelInferRequest is one for ``model`` whose contents hold
    what it declares, with the parameters Triton's protocol gives; whether it names
    shared memory."""
    if len(request.id) > MAX_ID:
        raise Refused(f"the request's id is over {MAX_ID} characters")
    _grpc_parameters(request.parameters, REQUEST_PARAMETERS, "the request")
    for tensor in request.inputs:
        _grpc_parameters(tensor.parameters, INPUT_PARAMETERS, "an input")
    for tensor in request.outputs:
        _grpc_parameters(tensor.parameters, OUTPUT_PARAMETERS, "an output")
    model.check_outputs([t.name for t in request.outputs])
    shared = any(
        key in t.parameters
        for t in (*request.inputs, *request.outputs)
        for key in SHARED_MEMORY_PARAMETERS
    )
    inputs = [(t.name, t.datatype, list(t.shape)) for t in request.inputs]
    if not inputs:
        raise Refused(f"{model.name}: the request has no inputs")
    sizes = model.check(inputs)
    raw = request.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise Refused(f"the request has {len(raw)} raw input contents for {len(inputs)} inputs")
    for k, (tensor, size) in enumerate(zip(request.inputs, sizes)):
        if raw:
            if tensor.HasField("contents") or "shared_memory_region" in tensor.parameters:
                raise Refused(f"input {tensor.name!r}: give raw contents, contents or a region")
            if tensor.datatype != "BYTES" and len(raw[k]) != size:
                raise Refused(
                    f"input {tensor.name!r}: {len(raw[k])} bytes of raw contents; shape "
                    f"{list(tensor.shape)} of {tensor.datatype} holds {size}"
                )
        elif tensor.HasField("contents"):
            field = tensor.contents.ListFields()
            if len(field) != 1 or "shared_memory_region" in tensor.parameters:
                raise Refused(f"input {tensor.name!r}: give one kind of contents")
            count = len(field[0][1])
            if count != math.prod(tensor.shape):
                raise Refused(
                    f"input {tensor.name!r}: {count} values; shape {list(tensor.shape)} "
                    f"declares {math.prod(tensor.shape)}"
                )
        elif "shared_memory_region" not in tensor.parameters:
            raise Refused(f"input {tensor.name!r} has no contents")
    return shared


def check_region(key, offset, byte_size, uid: int, private: str = "") -> None:
    """Refused unless ``key`` names a system shared-memory region (/dev/shm/NAME) that is
    user ``uid``'s alone, is not one whose name starts with ``private`` (the Python
    backend's own) and holds ``byte_size`` bytes from ``offset``."""
    if (
        not isinstance(key, str)
        or not re.fullmatch(r"/[!-.0-~]{1,250}", key)
        or key in ("/.", "/..")
    ):
        raise Refused(
            f"key {key!r:.80}: a shared-memory key is /NAME (printable ASCII, no '/' or "
            "space), a region in /dev/shm"
        )
    if private and key[1:].startswith(private):
        raise Refused(f"key {key!r}: the region is the server's own, not a client's")
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
            raise Refused(f"model {name!r}: not served here (serving {_names(models)})", 404)
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


def _names(models: dict) -> str:
    return ", ".join(models) or "nothing"


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
                    _check_keys(region, ("key", "offset", "byte_size"), "the registration")
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
                f"model {name[:100]!r}: not served here (serving {_names(self.models)})", 404
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
