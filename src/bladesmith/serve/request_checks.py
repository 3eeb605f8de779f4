"""What a request to the request front (``front``) must be before tritonserver sees it,
and the inference request re-encoded from what was checked.

The request (JSON header: strict, no key twice, no NaN; gRPC: protobuf) names the
model's inputs, each in its dtype and shape with a batch up to the model's, its outputs
by name and known parameters only, and declares at most the model's limit of tensor
bytes (its signature times its max batch, or ``--max-request-bytes``); its body holds
what it declares. tritonserver receives the request as the front re-encodes it from
what it checked (so both read the same request; JSON tensor data as binary data), never
the bytes sent. Triton 2.51 allocates what an HTTP/JSON request declares before it reads
the data (100 bytes declaring 16 GiB ended it) and has no input-size limit of its own.

Part of the front's process: like it, it imports neither torch nor bladesmith.
"""

from __future__ import annotations

import json
import math
import re
import sys
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

# A model, version or region name as it may appear in a path (Triton's model names are
# these; see repository.check_model_name).
NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"


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
            if not isinstance(shape, list) or not all(is_size(d) for d in shape):
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


def is_size(value) -> bool:
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
            ok = is_size(value) and value <= LARGEST_PARAMETER
        elif kind is str:
            ok = isinstance(value, str) and re.fullmatch(NAME, value) is not None
        else:
            ok = type(value) is kind
        if not ok:
            raise Refused(f"{where}: parameter {key!r} is {value!r:.40}, not a {kind.__name__}")
    return parameters


def check_keys(part: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [key for key in part if key not in allowed]
    if unknown:
        raise Refused(f"{where}: {unknown[0]!r} is not taken here (only {', '.join(allowed)})")


def check_http_infer(model: Model, header, binary: int) -> bool:
    """Refused unless an HTTP inference request's JSON ``header`` is one for ``model``
    whose ``binary`` bytes after it hold what it declares, and has only the keys and
    parameters Triton's protocol gives; whether it names shared memory."""
    if not isinstance(header, dict):
        raise Refused("the request is not a JSON object")
    check_keys(header, ("id", "parameters", "inputs", "outputs"), "the request")
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
        check_keys(tensor, ("name", "shape", "datatype", "parameters", "data"), "an input")
        _check_parameters(tensor.get("parameters", {}), INPUT_PARAMETERS, "an input")
    for tensor in outputs:
        check_keys(tensor, ("name", "parameters"), "an output")
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
            ok = given == "string_param" and re.fullmatch(NAME, value) is not None
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
