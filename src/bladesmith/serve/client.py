"""A client for a served bladesmith model: rows in (images, token ids, ...), one answer
per row out.

    detect = bladesmith.client("localhost:8000", "retinanet")   # or grpc://localhost:8001
    detections = detect(images)   # [{"boxes": ..., "scores": ..., "labels": ...}, ...]
    answers = bladesmith.client("localhost:8000", "tagger")(ids, mask)   # several inputs

The model's inputs (with their dtypes), outputs and maximum batch are read from the
server; rows are sent in its dtypes, in batches of at most that many rows. A client is
for one thread (tritonclient's HTTP client is not thread-safe): make one per thread for
concurrent requests.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from bladesmith.errors import BladesmithError
from bladesmith.serve.answers import cut_padding, is_detector
from bladesmith.serve.signature import NUMPY_DTYPES

# A host name or IPv4 address (an IPv6 address comes in brackets).
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")


class Client:
    def __init__(self, url: str, model: str, *, timeout: float = 120.0):
        self.url, self.model = url, model
        self.grpc, address = parse_url(url)
        try:
            if self.grpc:
                import tritonclient.grpc as triton
            else:
                import tritonclient.http as triton
        except ImportError:
            raise BladesmithError(
                "the client needs tritonclient: pip install 'bladesmith[serve]'"
            ) from None
        self._triton = triton
        options = {"network_timeout": timeout} if not self.grpc else {}
        self._client = triton.InferenceServerClient(address, **options)
        self._timeout = timeout
        metadata = self._call(self._client.get_model_metadata, model)
        config = self._call(self._client.get_model_config, model)
        if self.grpc:
            metadata = {
                "inputs": _grpc_tensors(metadata.inputs),
                "outputs": _grpc_tensors(metadata.outputs),
            }
            config = {
                "max_batch_size": config.config.max_batch_size,
                "parameters": {
                    key: {"string_value": value.string_value}
                    for key, value in config.config.parameters.items()
                },
            }
        self.inputs = [
            (t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]
        ]
        self.outputs = [t["name"] for t in metadata["outputs"]]
        self.max_batch = int(config.get("max_batch_size", 0))
        # The dtype the model computes in, where the server says (bladesmith's Python
        # backend does): how far an answer may move with the row's slot in a batch.
        parameters = config.get("parameters", {})
        self.compute_dtype = parameters.get("compute_dtype", {}).get("string_value")
        # An integer input's values in the artifact's test data, where the server says
        # (bladesmith's Python backend does): what test rows of it draw from.
        ranges = json.loads(parameters.get("input_ranges", {}).get("string_value") or "{}")
        self.input_ranges = {name: tuple(bounds) for name, bounds in ranges.items()}
        self.detections = is_detector(self.outputs)

    def _call(self, method, *args, **kwargs):
        from tritonclient.utils import InferenceServerException

        try:
            return method(*args, **kwargs)
        except InferenceServerException as error:
            raise BladesmithError(f"{self.url} ({self.model}): {error.message()}") from None
        except OSError as error:  # refused, reset, timed out: the server, not the request
            raise BladesmithError(f"{self.url} ({self.model}): cannot reach it: {error}") from None

    def infer(self, *arrays: np.ndarray, regions: list[str] | None = None) -> dict[str, np.ndarray]:
        """One request: the model's inputs (rows first) -> its outputs by name. With
        ``regions`` (names of system shared-memory regions registered with the server,
        one per input, holding the arrays: see ``shared_inputs``), only their names
        travel."""
        if len(arrays) != len(self.inputs):
            raise BladesmithError(
                f"{self.model} takes {len(self.inputs)} inputs, got {len(arrays)}"
            )
        tensors = []
        for k, ((name, datatype, _), array) in enumerate(zip(self.inputs, arrays)):
            array = _cast(_as_numpy(array), name, datatype)
            tensor = self._triton.InferInput(name, list(array.shape), datatype)
            if regions is None:
                tensor.set_data_from_numpy(np.ascontiguousarray(array))
            else:
                tensor.set_shared_memory(regions[k], array.nbytes)
            tensors.append(tensor)
        requested = [self._triton.InferRequestedOutput(name) for name in self.outputs]
        options = {"client_timeout": self._timeout} if self.grpc else {}
        result = self._call(self._client.infer, self.model, tensors, outputs=requested, **options)
        return {name: result.as_numpy(name) for name in self.outputs}

    def __call__(self, *inputs) -> list[dict]:
        """One dict per row, for the rows of each input (a batch [N, ...], a list of rows,
        or one row alone): a detector's boxes, scores and labels per image (and a Mask
        R-CNN's masks; as torch tensors, padding cut), another model's outputs by name. A
        detector's images are converted to the server's float32 or uint8; other inputs
        are cast to their served dtypes (int32 ids to int64, float64 to float32)."""
        import torch

        if len(inputs) != len(self.inputs):
            names = ", ".join(name for name, _, _ in self.inputs)
            raise BladesmithError(
                f"{self.model} takes {len(self.inputs)} inputs ({names}), got {len(inputs)}"
            )
        columns = [self._rows(rows, k) for k, rows in enumerate(inputs)]
        if self.detections:
            columns[0] = _as_served(columns[0], self.inputs[0][1])
        counts = sorted({column.shape[0] for column in columns})
        if len(counts) > 1:
            raise BladesmithError(f"{self.model}: the inputs differ in rows: {counts}")
        step = self.max_batch or counts[0]
        answers = []
        for start in range(0, counts[0], step):
            outputs = self.infer(*(column[start : start + step] for column in columns))
            for i in range(len(next(iter(outputs.values())))):
                answer = {name: value[i] for name, value in outputs.items()}
                # Cut before the copy: a view of the padded masks would keep them all.
                answer = cut_padding(answer) if self.detections else answer
                answers.append({name: torch.from_numpy(v.copy()) for name, v in answer.items()})
        return answers

    def _rows(self, given, k: int = 0) -> np.ndarray:
        """Input ``k``'s rows as one array: a list of rows, a batch, or one row alone (an
        array with the model's per-row rank); one line when they cannot be."""
        name, _, shape = self.inputs[k]
        per_row = shape[1:]  # [-1 or the fixed batch, *per row]
        noun = "images" if self.detections else "rows"
        if hasattr(given, "shape"):  # one array or tensor: a batch, or a single row
            array = _as_numpy(given)
            if list(per_row) == [1] and array.ndim == 1:  # one value per row (lengths)
                rows = array[:, None]
            else:
                rows = array[None] if array.ndim == len(per_row) else array
        else:
            given = list(given)
            if not given:
                raise BladesmithError(f"{self.model}: no {noun} given for {name!r} (an empty list)")
            arrays = [_as_numpy(row) for row in given]
            shapes = {array.shape for array in arrays}
            if len(shapes) != 1:
                raise BladesmithError(
                    f"{self.model}: the {noun} of {name!r} differ in shape ({sorted(shapes)}); "
                    f"it takes {_shape(per_row)} each"
                )
            rows = np.stack(arrays)
        if rows.ndim != len(per_row) + 1 or any(
            want >= 0 and got != want for got, want in zip(rows.shape[1:], per_row)
        ):
            raise BladesmithError(
                f"{self.model}: takes {noun} of shape {_shape(per_row)} (input {name!r}), "
                f"given {_shape(rows.shape[1:])} per row"
            )
        if rows.shape[0] == 0:
            raise BladesmithError(f"{self.model}: no {noun} given for {name!r} (a batch of 0)")
        return rows

    @contextmanager
    def shared_inputs(self, requests: list[list[np.ndarray]]):
        """Each request's arrays written once into system shared memory and registered
        with the server (which must run on this machine); yields each request's region
        names for ``infer(..., regions=)``, and unregisters and frees them after. Each
        region is made anew (mode 0600), under a name nobody can guess: a region someone
        else made under it is never written into."""
        from tritonclient.utils import shared_memory

        prefix = f"bladesmith-{secrets.token_hex(8)}"
        made, names = [], []
        try:
            for i, arrays in enumerate(requests):
                names.append([])
                for k, array in enumerate(arrays):
                    array = _cast(array, *self.inputs[k][:2])
                    name = f"{prefix}-{i}-{k}"
                    region = shared_memory.create_shared_memory_region(
                        name, f"/{name}", array.nbytes, create_only=True
                    )
                    made.append((name, region))
                    shared_memory.set_shared_memory_region(region, [np.ascontiguousarray(array)])
                    self._call(
                        self._client.register_system_shared_memory, name, f"/{name}", array.nbytes
                    )
                    names[-1].append(name)
            yield names
        finally:
            for name, region in made:
                try:
                    self._client.unregister_system_shared_memory(name)
                finally:
                    shared_memory.destroy_shared_memory_region(region)

    def statistics(self) -> ServerStatistics:
        """The server's running totals for this model (Triton's statistics extension)."""
        if self.grpc:
            found = self._call(self._client.get_inference_statistics, self.model, as_json=True)
        else:
            found = self._call(self._client.get_inference_statistics, self.model)
        return ServerStatistics.from_triton(found["model_stats"])

    def ready(self) -> bool:
        return bool(self._client.is_model_ready(self.model))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class ServerStatistics:
    """A served model's totals since the server started, summed over its versions:
    requests answered, model executions (batches), and nanoseconds spent by requests
    waiting in the queue and by executions computing (inputs, model, outputs)."""

    requests: int = 0
    executions: int = 0
    queue_ns: int = 0
    compute_ns: int = 0

    @classmethod
    def from_triton(cls, model_stats: list[dict]) -> ServerStatistics:
        total = cls()
        for stats in model_stats:  # gRPC's JSON writes 64-bit counts as strings
            queue = stats.get("inference_stats", {}).get("queue", {})
            # Per batch size, each execution's compute counted once (the per-request
            # totals count a batch's once per request).
            compute = sum(
                int(batch.get(part, {}).get("ns", 0))
                for batch in stats.get("batch_stats", [])
                for part in ("compute_input", "compute_infer", "compute_output")
            )
            total = cls(
                total.requests + int(stats.get("inference_count", 0)),
                total.executions + int(stats.get("execution_count", 0)),
                total.queue_ns + int(queue.get("ns", 0)),
                total.compute_ns + compute,
            )
        return total

    def __sub__(self, earlier: ServerStatistics) -> ServerStatistics:
        return ServerStatistics(
            self.requests - earlier.requests,
            self.executions - earlier.executions,
            self.queue_ns - earlier.queue_ns,
            self.compute_ns - earlier.compute_ns,
        )


def parse_url(url: str) -> tuple[bool, str]:
    """``host:port`` (or ``http://host:port``) -> (False, "host:port"); ``grpc://host:port``
    -> (True, "host:port"); anything else: one line naming the URL. The host is a name or
    IPv4 address, or an IPv6 address in brackets."""
    text = str(url)
    grpc = text.startswith("grpc://")
    address = text.removeprefix("grpc://").removeprefix("http://")
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        valid = _is_ipv6(host[1:-1])
    else:
        valid = bool(_HOST_NAME.fullmatch(host))
    if not (valid and re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535):
        raise BladesmithError(
            f"URL {text!r}: expected host:port for HTTP or grpc://host:port for gRPC, "
            "e.g. localhost:8000, grpc://localhost:8001 or [::1]:8000"
        )
    return grpc, address


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def client(url: str, model: str, *, timeout: float = 120.0) -> Client:
    """A client for ``model`` served at ``url`` (``host:port`` for HTTP,
    ``grpc://host:port`` for gRPC); call it with images."""
    return Client(url, model, timeout=timeout)


def _shape(dims) -> str:
    return "[" + ", ".join("any" if int(d) < 0 else str(int(d)) for d in dims) + "]"


def _as_served(rows: np.ndarray, datatype: str) -> np.ndarray:
    """Images as the server takes them: float32 in [0, 1], or uint8 in [0, 255] (a
    server started with ``--image-dtype uint8``); either kind is converted. Float images
    for a uint8 server must be finite and in [0, 1] (the server cannot see what a
    conversion would hide)."""
    if datatype == "UINT8":
        if rows.dtype == np.uint8:
            return rows
        with np.errstate(invalid="ignore"):
            if not np.isfinite(rows).all():
                raise BladesmithError(
                    "images have non-finite values (NaN or infinity): refused, not sent"
                )
            low, high = float(rows.min()), float(rows.max())
        if low < -_SLACK or high > 1 + _SLACK:
            raise BladesmithError(
                f"float images must be in [0, 1] (the server takes uint8 = round(x * 255)); "
                f"these span [{low:g}, {high:g}]: scale them, or send uint8 images"
            )
        return np.clip(np.rint(rows * 255.0), 0, 255).astype(np.uint8)
    if rows.dtype == np.uint8:
        return rows.astype(np.float32) / np.float32(255)
    return rows.astype(np.float32)


def _cast(array: np.ndarray, name: str, datatype: str) -> np.ndarray:
    """``array`` in its input's served dtype, where numpy casts it within its kind or up
    (int32 ids to int64, float64 to float32, integers to floats); floats are not cut to
    integers. A dtype bladesmith does not serve goes as it is, for the server to judge."""
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None or array.dtype == dtype:
        return array
    if not np.can_cast(array.dtype, dtype, "same_kind"):
        raise BladesmithError(
            f"input {name!r} takes {datatype}, given {array.dtype}: convert it first"
        )
    return array.astype(dtype)


_SLACK = 1e-6  # rounding past [0, 1] that a float computation may leave


def _as_numpy(image) -> np.ndarray:
    if hasattr(image, "detach"):
        return image.detach().cpu().numpy()
    return np.asarray(image)


def _grpc_tensors(tensors) -> list[dict]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]
