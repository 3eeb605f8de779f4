"""What the request front's tests share: the tiny net served (shared memory on), raw HTTP
exchanges and gRPC calls sent as they are, the answers a good request must get, and the
memory the server's processes hold."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import grpc
import numpy as np
import torch
from serve_testing import free_ports, tiny_net
from tritonclient.grpc import service_pb2

import bladesmith

MAX_BATCH = 8
ROW_BYTES = 3 * 8 * 8 * 4  # the tiny net's input row, float32
# gRPC's answers to a request refused for what it is: never INTERNAL, UNKNOWN, UNAVAILABLE.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,  # a method the front does not serve: gRPC's 404
}


def serve_net(artifact, log: Path | None = None):
    """The tiny net served at batches up to MAX_BATCH, shared memory on (a started
    Server: a context manager)."""
    http, grpc_port, metrics = free_ports(3)
    return bladesmith.serve(
        artifact,
        http_port=http,
        grpc_port=grpc_port,
        metrics_port=metrics,
        max_batch=MAX_BATCH,
        shared_memory=True,
        block=False,
        log=log,
    )


def post(server, body: bytes, headers: dict | None = None, path="/v2/models/net/infer"):
    """(status, answer) of an HTTP POST of ``body``, sent as it is on a socket of its own."""
    head = "".join(f"{key}: {value}\r\n" for key, value in (headers or {}).items())
    if "Content-Length" not in (headers or {}):
        head += f"Content-Length: {len(body)}\r\n"
    request = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n"
    return exchange(server.http_port, request.encode("utf-8", "surrogateescape") + body)[::2]


def get(server, path: str, headers: dict | None = None):
    """(status, answer) of an HTTP GET of ``path`` (as it is)."""
    head = "".join(f"{key}: {value}\r\n" for key, value in (headers or {}).items())
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n"
    return exchange(server.http_port, request.encode("utf-8", "surrogateescape"))[::2]


def exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """What the server answers ``data``: (status, headers with lower-case names, body);
    (0, {}, b"") where it closed without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(data)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    if not answer:
        return 0, {}, b""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split(" ", 2)[1]), headers, body


def json_request(shape, data=None, datatype="FP32", name="input_0") -> bytes:
    tensor = {
        "name": name,
        "shape": shape,
        "datatype": datatype,
        "data": [] if data is None else data,
    }
    return json.dumps({"inputs": [tensor]}).encode()


def grpc_infer(server, tensors, raw=None, model="net"):
    """A ModelInferRequest sent as it is; (code, details) of the refusal ((None, None):
    answered)."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.extend(raw)
    return grpc_call(server, "ModelInfer", request.SerializeToString())


def grpc_call(server, method: str, message: bytes, metadata=()):
    """(code, details) of a gRPC call of ``method`` with ``message`` as it is ((None,
    None): answered)."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        try:
            call(message, timeout=30, metadata=metadata)
        except grpc.RpcError as error:
            return error.code(), error.details()
    return None, None


def expected_scores(rows: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return tiny_net()(torch.from_numpy(rows))[0].numpy()


def answers_correctly(server) -> None:
    """Good requests, over HTTP and gRPC, get the tiny net's answers."""
    rows = np.random.default_rng(1).standard_normal((5, 3, 8, 8), dtype=np.float32)
    for url in (server.url, server.grpc_url):
        with bladesmith.client(url, "net") as client:
            got = np.stack([answer["output_0"].numpy() for answer in client(rows)])
        np.testing.assert_allclose(got, expected_scores(rows), rtol=1e-4, atol=1e-5)


def resident_bytes(server) -> dict[str, int]:
    """The memory each of the server's processes holds (resident): tritonserver, the
    front, the model instances together."""
    from bladesmith.serve.server import _group_members

    def resident(pid: int) -> int:
        try:
            fields = Path(f"/proc/{pid}/statm").read_text().split()
        except OSError:
            return 0
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")

    triton, front = server._process.pid, server._front.pid
    stubs = [pid for pid in _group_members(triton) if pid != triton]
    return {
        "tritonserver": resident(triton),
        "front": resident(front),
        "instances": sum(resident(pid) for pid in stubs),
    }
