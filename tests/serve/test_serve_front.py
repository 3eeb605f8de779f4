"""The request front of `bladesmith serve`, on the real bundled tritonserver: requests
declaring more than the limit, malformed ones (a seeded fuzz of 200) and shared memory
are refused with a 4xx before Triton sees them, and the server keeps answering. One
server for the module (starting Triton takes seconds)."""

from __future__ import annotations

import gzip
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")
import grpc  # noqa: E402
import tritonclient.http as triton  # noqa: E402
from serve_testing import free_ports, tiny_net  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402

import bladesmith  # noqa: E402

MAX_BATCH = 8
ROW_BYTES = 3 * 8 * 8 * 4  # the tiny net's input row, float32
# gRPC's answers to a request refused for what it is: never INTERNAL, UNKNOWN, UNAVAILABLE.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
}


@pytest.fixture(scope="module")
def server(net_artifacts):
    http, grpc_port, metrics = free_ports(3)
    with bladesmith.serve(
        net_artifacts[".pt"],
        http_port=http,
        grpc_port=grpc_port,
        metrics_port=metrics,
        max_batch=MAX_BATCH,
        shared_memory=True,
        block=False,
    ) as started:
        yield started


def _post(server, body: bytes, headers: dict | None = None, path="/v2/models/net/infer"):
    """(status, answer) of an HTTP POST of ``body``, sent as it is on a socket of its own."""
    head = "".join(f"{key}: {value}\r\n" for key, value in (headers or {}).items())
    if "Content-Length" not in (headers or {}):
        head += f"Content-Length: {len(body)}\r\n"
    request = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n".encode()
    return _exchange(server.http_port, request + body)


def _exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    """What the server answers ``data`` (status, body); (0, b"") where it closed without."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(data)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    if not answer:
        return 0, b""
    status = int(answer.split(b" ", 2)[1])
    return status, answer.partition(b"\r\n\r\n")[2]


def _json_request(shape, data=None, datatype="FP32", name="input_0") -> bytes:
    tensor = {
        "name": name,
        "shape": shape,
        "datatype": datatype,
        "data": [] if data is None else data,
    }
    return json.dumps({"inputs": [tensor]}).encode()


def _grpc_infer(server, tensors, raw=None, model="net"):
    """A ModelInferRequest sent as it is; the status code of the refusal (None: answered)."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.extend(raw)
    return _grpc_call(server, "ModelInfer", request.SerializeToString())


def _grpc_call(server, method: str, message: bytes):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        try:
            call(message, timeout=30)
        except grpc.RpcError as error:
            return error.code(), error.details()
    return None, None


def _answers_correctly(server) -> None:
    """Good requests, over HTTP and gRPC, get the tiny net's answers."""
    rows = np.random.default_rng(1).standard_normal((5, 3, 8, 8), dtype=np.float32)
    with torch.no_grad():
        expected = tiny_net()(torch.from_numpy(rows))[0]
    for url in (server.url, server.grpc_url):
        with bladesmith.client(url, "net") as client:
            got = torch.stack([answer["output_0"] for answer in client(rows)])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_request_declaring_more_than_the_limit_is_refused_before_anything_is_allocated(
    server,
):
    # Once, one request of 100 bytes declaring 16 GiB (HTTP/JSON, no data) ended Triton:
    # it allocated what was declared before reading the data.
    limit = MAX_BATCH * ROW_BYTES
    for shape in ([8192, 8192], [65536, 65536], [MAX_BATCH + 1, 3, 8, 8], [2**62, 2**62]):
        declared = int(np.prod(shape, dtype=object)) * 4
        status, answer = _post(server, _json_request(shape))
        reason = json.loads(answer)["error"]
        assert status == 400, (shape, status, answer)
        assert reason == (
            f"net: the request declares {declared} bytes of inputs, over this server's "
            f"limit of {limit} (--max-request-bytes)"
        )
        # The binary protocol and gRPC alike.
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "input_0",
                        "shape": shape,
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 16},
                    }
                ]
            }  # fmt: skip
        ).encode()
        status, answer = _post(
            server, header + bytes(16), {"Inference-Header-Content-Length": len(header)}
        )
        assert status == 400 and "--max-request-bytes" in json.loads(answer)["error"]
        code, details = _grpc_infer(server, [("input_0", "FP32", shape)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-request-bytes" in details
    # A body larger than the limit allows is refused from its Content-Length, unread.
    status, answer = _exchange(
        server.http_port,
        b"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n",
    )
    assert status == 400 and "over the" in json.loads(answer)["error"]
    assert server.ready() and server.running()
    _answers_correctly(server)


def test_the_limit_is_the_models_inputs_times_its_max_batch_or_the_flags(server, capsys):
    from bladesmith.serve.front import UNBOUNDED_LIMIT, models_of

    [model] = models_of(server.repository, None).values()
    assert (model.limit, model.max_batch) == (MAX_BATCH * ROW_BYTES, MAX_BATCH)
    assert models_of(server.repository, 1000)["net"].limit == 1000
    assert UNBOUNDED_LIMIT == 64 << 20  # a model whose config leaves a size free
    from bladesmith.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--max-request-bytes BYTES refuse (HTTP 400, gRPC INVALID_ARGUMENT)" in said
    assert "--shared-memory serve Triton's shared-memory API" in said


def _fuzz_requests(seed: int, count: int):
    """``count`` malformed requests, drawn from ``seed``: (kind, send) where send()
    returns the HTTP status or the gRPC status code."""
    rng = np.random.default_rng(seed)
    good = np.zeros((1, 3, 8, 8), np.float32)

    def shape() -> list:
        choices = [
            [int(rng.integers(1, 2**40)), 3, 8, 8],
            [int(rng.integers(-(2**40), 0)), 3, 8, 8],
            [1, 3, int(rng.integers(9, 2**20)), 8],
            [1, 3, 8],
            [1, 3, 8, 8, 1],
            [],
            [int(rng.integers(0, 4)), 3, 8, 8],
        ]
        return choices[int(rng.integers(len(choices)))]

    def http_json(server):
        kinds = [
            lambda: _json_request(shape()),
            lambda: _json_request([1, 3, 8, 8], data=[0.5] * int(rng.integers(0, 400))),
            lambda: _json_request([1, 3, 8, 8], data=["x"] * 192),
            lambda: _json_request([1, 3, 8, 8], data=[{"a": 1}] * 192),
            lambda: _json_request(
                [1, 3, 8, 8],
                [0.5] * 192,
                datatype=str(rng.choice(["FP64", "INT64", "FP99", "", "BYTES"])),
            ),  # fmt: skip
            lambda: _json_request([1, 3, 8, 8], [0.5] * 192, name="nothing"),
            lambda: _json_request("1,3,8,8", [0.5] * 192),
            lambda: json.dumps({"inputs": "no"}).encode(),
            lambda: json.dumps({"inputs": []}).encode(),
            lambda: json.dumps([1, 2]).encode(),
            lambda: json.dumps(
                {
                    "inputs": [
                        {
                            "name": "input_0",
                            "shape": [1, 3, 8, 8],
                            "datatype": "FP32",
                            "data": [0.5] * 192,
                        }
                    ]
                    * 2
                }
            ).encode(),  # fmt: skip
            lambda: json.dumps(
                {"inputs": [{"name": "input_0", "shape": [1, 3, 8, 8], "datatype": "FP32"}]}
            ).encode(),  # fmt: skip
            lambda: json.dumps(
                {
                    "id": 5,
                    "inputs": [
                        {
                            "name": "input_0",
                            "shape": [1, 3, 8, 8],
                            "datatype": "FP32",
                            "data": [0.5] * 192,
                        }
                    ],
                }
            ).encode(),  # fmt: skip
            lambda: _json_request([1, 3, 8, 8], [0.5] * 192)[: int(rng.integers(1, 60))],
            lambda: bytes(rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8)),
        ]
        body = kinds[int(rng.integers(len(kinds)))]()
        return lambda: _post(server, body)[0]

    def http_binary(server):
        rows, lie = int(rng.integers(1, 4)), int(rng.integers(0, 4))
        size = rows * ROW_BYTES
        declared = [size + int(rng.integers(1, 100)), size, size, -5][lie]
        parameters = {"binary_data_size": declared}
        tensor = {"name": "input_0", "shape": [rows, 3, 8, 8], "datatype": "FP32"}
        header = json.dumps({"inputs": [{**tensor, "parameters": parameters}]}).encode()
        data = bytes(size - int(rng.integers(1, size)) if lie == 1 else size + (lie == 2) * 7)
        length = len(header)
        if rng.integers(2):
            length = str(rng.choice([str(len(header) + len(data) + 10), "-3", "abc", "1e3"]))
        body = header + data
        return lambda: _post(server, body, {"Inference-Header-Content-Length": length})[0]

    def http_transport(server):
        body = _json_request([1, 3, 8, 8], [0.5] * 192)
        kinds = [
            # Lying Content-Lengths: more than is sent (then silence), less, nonsense.
            lambda: _exchange(
                server.http_port,
                b"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body,
            )[0],  # fmt: skip
            lambda: _exchange(
                server.http_port,
                b"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % (len(body) // 2) + body,
            )[0],  # fmt: skip
            lambda: _post(server, body, {"Content-Length": "-1"})[0],
            lambda: _post(server, gzip.compress(bytes(50 << 20)), {"Content-Encoding": "gzip"})[0],
            lambda: _post(server, body, {"Content-Encoding": "gzip"})[0],
            lambda: _post(server, b"{}", path="/v2/logging")[0],
            lambda: _post(server, b"{}", path="/v2/systemsharedmemory/region/x/register")[0],
            lambda: _exchange(server.http_port, b"GARBAGE\r\n\r\n")[0],
        ]
        return kinds[int(rng.integers(len(kinds)))]

    def grpc_infer(server):
        size = ROW_BYTES
        kinds = [
            lambda: _grpc_infer(server, [("input_0", "FP32", shape())]),
            lambda: _grpc_infer(
                server,
                [("input_0", "FP32", [1, 3, 8, 8])],
                raw=[bytes(size - int(rng.integers(1, size)))],
            ),  # fmt: skip
            lambda: _grpc_infer(
                server,
                [("input_0", str(rng.choice(["FP64", "INT8", "X"])), [1, 3, 8, 8])],
                raw=[bytes(size)],
            ),  # fmt: skip
            lambda: _grpc_infer(
                server, [("input_0", "FP32", [1, 3, 8, 8])] * 2, raw=[bytes(size)] * 2
            ),  # fmt: skip
            lambda: _grpc_infer(server, [("other", "FP32", [1, 3, 8, 8])], raw=[bytes(size)]),
            lambda: _grpc_infer(server, [("input_0", "FP32", [1, 3, 8, 8])], raw=[bytes(size)] * 2),
            lambda: _grpc_infer(server, [("input_0", "FP32", [1, 3, 8, 8])]),
            lambda: _grpc_call(
                server,
                "ModelInfer",
                bytes(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8)),
            ),  # fmt: skip
            lambda: _grpc_call(server, "SystemSharedMemoryRegister", b"\x0a\x01x"),
            lambda: _grpc_call(server, "LogSettings", b""),
        ]
        pick = kinds[int(rng.integers(len(kinds)))]
        return lambda: pick()[0]

    makers = [http_json, http_binary, http_transport, grpc_infer]
    return [makers[i % len(makers)] for i in range(count)], good


def test_200_malformed_requests_are_each_refused_with_a_4xx_and_the_server_still_answers(server):
    makers, _ = _fuzz_requests(seed=34, count=200)
    sends = [(maker.__name__, maker(server)) for maker in makers]
    started = time.monotonic()
    # In parallel: requests whose body never completes wait out the front's 10 s.
    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda sent: (sent[0], sent[1]()), sends))
    took = time.monotonic() - started
    wrong = [
        (kind, outcome)
        for kind, outcome in outcomes
        if not (isinstance(outcome, int) and 400 <= outcome < 500) and outcome not in CLIENT_ERRORS
    ]
    assert not wrong, f"{len(wrong)} of {len(outcomes)} not refused as the client's: {wrong[:10]}"
    assert len(outcomes) == 200 and took < 60, took
    assert {kind for kind, _ in outcomes} == {
        "http_json",
        "http_binary",
        "http_transport",
        "grpc_infer",
    }
    assert server.ready() and server.running()
    _answers_correctly(server)


def _as_nobody(server, requests: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    """What the server answers each (path, JSON body) POSTed by another user (nobody),
    from a process of this machine (forked: nobody cannot read this Python's files)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            answers = [_post(server, body, path=path) for path, body in requests]
            os.write(write, json.dumps([[s, b.decode()] for s, b in answers]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as said:
        answers = json.loads(said.read() or "[]")
    os.waitpid(child, 0)
    return answers


def test_shared_memory_is_served_to_the_serving_user_only_and_its_regions_are_0600(server):
    from tritonclient.utils import shared_memory

    # The Python backend's regions, and a client's, are the serving user's alone.
    regions = [
        path for path in Path("/dev/shm").iterdir() if path.name.startswith(server._shm_prefix)
    ]
    assert regions and all(path.stat().st_mode & 0o777 == 0o600 for path in regions)
    row = np.random.default_rng(2).standard_normal((1, 3, 8, 8), dtype=np.float32)
    with bladesmith.client(server.url, "net") as client:
        with client.shared_inputs([[row]]) as [names]:
            region = Path("/dev/shm") / names[0]
            assert region.stat().st_mode & 0o777 == 0o600
            served = client.infer(row, regions=names)["output_0"]
            assert [r["name"] for r in client._client.get_system_shared_memory_status()] == names
            if os.getuid() == 0:
                # Another user of this machine: refused the API and requests naming a region.
                region_input = {"name": "input_0", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                "parameters": {"shared_memory_region": names[0],
                                               "shared_memory_byte_size": ROW_BYTES}}  # fmt: skip
                key = {"key": f"/{names[0]}", "offset": 0, "byte_size": ROW_BYTES}
                answers = _as_nobody(server, [
                    ("/v2/systemsharedmemory/status", b""),
                    ("/v2/systemsharedmemory/region/y/register", json.dumps(key).encode()),
                    (f"/v2/systemsharedmemory/region/{names[0]}/unregister", b""),
                    ("/v2/models/net/infer", json.dumps({"inputs": [region_input]}).encode()),
                ])  # fmt: skip
                assert len(answers) == 4, answers
                for status, answer in answers:
                    assert status == 400, answers
                    assert "the serving user's own connections only" in answer, answers
            # The serving user's registration: its own regions of mode 0600 only.
            other = Path("/dev/shm/bladesmith-open-region")
            other.write_bytes(bytes(ROW_BYTES))
            other.chmod(0o644)
            try:
                for key, size, why in (
                    (f"/{other.name}", ROW_BYTES, "not the serving user's alone"),
                    ("/bladesmith-no-such-region", ROW_BYTES, "no such shared-memory region"),
                    (f"/{names[0]}", 10**9, "not within"),
                    ("/../etc/passwd", 10, "a shared-memory key is /NAME"),
                ):
                    body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
                    status, answer = _post(
                        server, body, path="/v2/systemsharedmemory/region/z/register"
                    )
                    assert status == 400 and why in json.loads(answer)["error"], answer
                    message = service_pb2.SystemSharedMemoryRegisterRequest(
                        name="z", key=key, byte_size=size
                    ).SerializeToString()
                    code, details = _grpc_call(server, "SystemSharedMemoryRegister", message)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details, details
            finally:
                other.unlink()
    with torch.no_grad():
        expected = tiny_net()(torch.from_numpy(row))[0].numpy()
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)
    # A region somebody else made under the client's name is never written into.
    taken = shared_memory.create_shared_memory_region("t", "/bladesmith-taken-0-0", ROW_BYTES)
    try:
        from unittest import mock

        with (
            mock.patch("secrets.token_hex", return_value="taken"),
            bladesmith.client(server.url, "net") as client,
        ):
            with pytest.raises(shared_memory.SharedMemoryException):
                with client.shared_inputs([[row]]):
                    pass
        assert not shared_memory.get_contents_as_numpy(taken, np.float32, [192]).any()
    finally:
        shared_memory.destroy_shared_memory_region(taken)
    with triton.InferenceServerClient(server.url) as client:
        assert client.get_system_shared_memory_status() == []


def test_shared_memory_is_refused_to_a_peer_that_is_no_connection_of_this_machine(server):
    from bladesmith.serve.front import Front

    front = Front({"repository": str(server.repository), "shared_memory": True})
    assert front.shared_memory_refusal(("192.0.2.1", 40000), server.http_port) == (
        "shared memory is served to the serving user's own connections only"
    )
