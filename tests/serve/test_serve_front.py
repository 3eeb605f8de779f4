"""The request front of `bladesmith serve`, on the real bundled tritonserver: requests
declaring more than the limit, malformed ones (a seeded fuzz of 200) and shared memory
are refused with a 4xx before Triton sees them, and the server keeps answering. One
server for the module (starting Triton takes seconds)."""

from __future__ import annotations

import gzip
import json
import os
import socket
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")
import grpc  # noqa: E402
import tritonclient.http as triton  # noqa: E402
from front_testing import (  # noqa: E402
    MAX_BATCH,
    ROW_BYTES,
    answers_correctly,
    exchange,
    expected_scores,
    get,
    grpc_call,
    grpc_infer,
    json_request,
    post,
    resident_bytes,
    serve_net,
)
from tritonclient.grpc import service_pb2  # noqa: E402

import bladesmith  # noqa: E402


@pytest.fixture(scope="module")
def server(net_artifacts):
    with serve_net(net_artifacts[".pt"]) as started:
        yield started


def test_a_request_declaring_more_than_the_limit_is_refused_before_anything_is_allocated(
    server,
):
    # Once, one request of 100 bytes declaring 16 GiB (HTTP/JSON, no data) ended Triton:
    # it allocated what was declared before reading the data.
    limit = MAX_BATCH * ROW_BYTES
    for shape in ([8192, 8192], [65536, 65536], [MAX_BATCH + 1, 3, 8, 8], [2**62, 2**62]):
        declared = int(np.prod(shape, dtype=object)) * 4
        status, answer = post(server, json_request(shape))
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
        status, answer = post(
            server, header + bytes(16), {"Inference-Header-Content-Length": len(header)}
        )
        assert status == 400 and "--max-request-bytes" in json.loads(answer)["error"]
        code, details = grpc_infer(server, [("input_0", "FP32", shape)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-request-bytes" in details
    # A body larger than the limit allows is refused from its Content-Length, unread.
    status, _, answer = exchange(
        server.http_port,
        b"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n",
    )
    assert status == 400 and "over the" in json.loads(answer)["error"]
    assert server.ready() and server.running()
    answers_correctly(server)


# The request of issue 43: 100 bytes declaring 8x3x65536x65536 floats (24 GiB), once sent
# where a `..` took Triton to another route than the front had checked.
HUGE = {"name": "input_0", "shape": [8, 3, 65536, 65536], "datatype": "FP32", "data": [1.0]}
ROW = {"name": "input_0", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.5] * 192}
PATH_TRICKS = (
    "/v2/models/x/../net/infer", "/v2/models/net/./infer", "/v2/models/%2e%2e/net/infer",
    "/v2/models/x/%2E%2E/net/infer", "/v2/models/net%2Finfer", "/v2/models/net%2finfer",
    "//v2/models/net/infer", "/v2//models/net/infer", "/v2/models/net/infer/",
    "/v2/models/net/infer?x=1", "/v2/models/net/infer;x", "/v2/models/net\\infer",
    "/v2/models/net/infer%00", "http://x/v2/models/net/infer", "/v2/models/n%65t/infer",
    "/v2/models/net/infer/..", "/v2/models/n\u00e9t/infer", "/v2/models/.net/infer",
    "/v2/models/net/versions/1/../../net/infer", "/v2/models/net/versions/01/infer",
    "/v2/models/net/versions/-1/infer",
)  # fmt: skip
# The APIs tritonserver itself holds behind a header nobody is given.
LOCKED_ROUTES = (
    ("GET", "/v2/logging"), ("POST", "/v2/logging"), ("GET", "/v2/trace/setting"),
    ("POST", "/v2/trace/setting"), ("POST", "/v2/models/net/trace/setting"),
    ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/net/load"),
    ("POST", "/v2/repository/models/net/unload"),
)  # fmt: skip


def _triton_itself(server, method: str, path: str, headers: dict | None = None, body=b""):
    """(status, answer) of a request straight to tritonserver's HTTP socket (the serving
    user's alone), around the front."""
    head = "".join(f"{key}: {value}\r\n" for key, value in (headers or {}).items())
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(30)
        connection.connect(str(Path(server._workdir.name) / "http"))
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _restricted(server) -> dict[str, str]:
    """The headers tritonserver's command line names: {header: value}."""
    command = Path(f"/proc/{server._process.pid}/cmdline").read_bytes().decode().split("\0")
    flags = [flag for flag in command if flag.startswith("--http-restricted-api=")]
    return dict(flag.split(":", 1)[1].split("=", 1) for flag in flags)


def test_no_path_trick_reaches_another_route_and_a_huge_shape_allocates_nothing(server):
    before = resident_bytes(server)["tritonserver"]
    for path in PATH_TRICKS:
        for tensor in (HUGE, ROW):
            body = json.dumps({"inputs": [tensor]}).encode()
            status, answer = post(server, body, path=path)
            assert status in (400, 404), (path, status, answer)
            if status == 400 and answer.startswith(b"{"):  # else aiohttp's parser refused it
                assert "not a plain path" in json.loads(answer)["error"], answer
        status, _ = get(server, path.replace("/infer", "/config"))
        assert status in (400, 404), (path, status)
    # Through `..`, the log settings and shared memory were reached: no longer.
    settings = _triton_itself(server, "GET", "/v2/logging", _restricted(server))
    for path, body in (
        ("/v2/x/../logging", b'{"log_verbose_level": 1}'),
        ("/v2/models/x/../../logging", b'{"log_info": false}'),
        ("/v2/x/%2e%2e/logging", b'{"log_info": false}'),
        ("/v2/x/../systemsharedmemory/region/s/register", b'{"key": "/x", "byte_size": 8}'),
    ):
        assert post(server, body, path=path)[0] == 400
    assert _triton_itself(server, "GET", "/v2/logging", _restricted(server)) == settings
    # What was declared was never allocated (the request once took Triton to 3.1 GB).
    assert resident_bytes(server)["tritonserver"] < before + (100 << 20)
    assert server.ready() and server.running()
    answers_correctly(server)


def test_a_key_given_twice_anywhere_is_refused(server):
    row = json.dumps(ROW, separators=(",", ":"))
    twice = (
        # The issue's: Triton read the first copy, the front had checked the last.
        row.replace('"shape":', '"shape":[8,3,65536,65536],"shape":'),
        row.replace('"shape":[1,3,8,8]', '"shape":[1,3,8,8],"shape":[8,3,65536,65536]'),
        row.replace('"name":"input_0"', '"name":"input_0","name":"other"'),
        row.replace('"datatype":"FP32"', '"datatype":"FP32","datatype":"FP64"'),
    )
    bodies = [f'{{"inputs":[{tensor}]}}' for tensor in twice] + [
        f'{{"inputs":[{json.dumps(HUGE)}],"inputs":[{row}]}}',
        f'{{"inputs":[{row}],"id":"a","id":"b"}}',
        f'{{"inputs":[{row}],"parameters":{{"priority":1,"priority":2}}}}',
        f'{{"inputs":[{row}],"outputs":[{{"name":"output_0","parameters":'
        f'{{"binary_data":true,"binary_data":false}}}}]}}',
    ]
    for body in bodies:
        status, answer = post(server, body.encode())
        assert status == 400 and "is given twice" in json.loads(answer)["error"], (body, answer)
    status, answer = post(
        server,
        b'{"key": "/x", "key": "/y", "byte_size": 8}',
        path="/v2/systemsharedmemory/region/s/register",
    )
    assert status == 400 and "'key' is given twice" in json.loads(answer)["error"]
    # The same request with each key once is answered.
    status, answer = post(server, f'{{"inputs":[{row}]}}'.encode())
    assert status == 200, answer


def test_only_the_routes_the_front_knows_are_served(server):
    for method, path in (*LOCKED_ROUTES, ("POST", "/v2/models/net/generate"),
                         ("POST", "/v2/models/net/generate_stream"), ("GET", "/v2/models"),
                         ("POST", "/v2/models/net/versions/1/generate"), ("GET", "/metrics"),
                         ("GET", "/v2/models/other/config"), ("POST", "/v2/models/other/infer"),
                         ("PUT", "/v2/models/net/infer"), ("GET", "/v2/models/net/infer"),
                         ("POST", "/v2/health/ready"), ("DELETE", "/v2/models/net")):  # fmt: skip
        request = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        request += "Content-Length: 2\r\n\r\n{}"
        status, _, answer = exchange(server.http_port, request.encode())
        assert status in (404, 405), (method, path, status, answer)
        assert json.loads(answer)["error"], answer
    for path in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/net",
                 "/v2/models/net/ready", "/v2/models/net/config", "/v2/models/net/stats",
                 "/v2/models/stats", "/v2/models/net/versions/1/config"):  # fmt: skip
        assert get(server, path)[0] == 200, path
    # gRPC: the methods the front does not serve are not there; other models neither.
    for method in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
                   "TraceSetting", "LogSettings", "NoSuchMethod"):  # fmt: skip
        code, _ = grpc_call(server, method, b"")
        assert code == grpc.StatusCode.UNIMPLEMENTED, (method, code)
    for method, message in (
        ("ModelMetadata", service_pb2.ModelMetadataRequest(name="other")),
        ("ModelConfig", service_pb2.ModelConfigRequest(name="../net")),
        ("ModelReady", service_pb2.ModelReadyRequest(name="")),
        ("ModelStatistics", service_pb2.ModelStatisticsRequest(name="other")),
    ):
        code, details = grpc_call(server, method, message.SerializeToString())
        assert code == grpc.StatusCode.NOT_FOUND and "not served here" in details, details
    code, details = grpc_infer(server, [("input_0", "FP32", [1, 3, 8, 8])], model="other")
    assert code == grpc.StatusCode.NOT_FOUND, details
    with triton.InferenceServerClient(server.url) as client:
        assert client.is_model_ready("net")


def test_tritonserver_itself_locks_the_apis_the_front_does_not_serve(server):
    # Around the front (its socket is the serving user's alone): the door is locked too.
    for method, path in LOCKED_ROUTES:
        status, answer = _triton_itself(server, method, path, body=b"{}")
        assert status == 403 and b"restricted" in answer, (path, status, answer)
    status, _ = _triton_itself(server, "GET", "/v2/systemsharedmemory/status")
    assert status == 403  # only the front's header opens it
    header = {"bladesmith-shared-memory": _restricted(server)["bladesmith-shared-memory"]}
    assert _triton_itself(server, "GET", "/v2/systemsharedmemory/status", header)[0] == 200
    # The values are on the command line: sent through the front, they open nothing.
    for method, path in LOCKED_ROUTES:
        request = (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
            + "".join(f"{key}: {value}\r\n" for key, value in _restricted(server).items())
            + "\r\n{}"
        )
        assert exchange(server.http_port, request.encode())[0] == 404
    metadata = [
        (f"triton-grpc-protocol-{key}", value) for key, value in _restricted(server).items()
    ]
    for method in ("RepositoryModelUnload", "LogSettings"):
        message = service_pb2.RepositoryModelUnloadRequest(model_name="net").SerializeToString()
        code, _ = grpc_call(server, method, message, metadata)
        assert code == grpc.StatusCode.UNIMPLEMENTED
    assert server.ready()


def test_every_client_error_is_a_4xx_with_one_line(server):
    row = json.dumps({"inputs": [ROW]}).encode()
    deep = 100_000
    bodies = [
        b"[" * deep + b"]" * deep,
        b'{"a":' * deep + b"1" + b"}" * deep,
        b'{"inputs":' + b"[" * deep + b"]" * deep + b"}",
        json.dumps({"inputs": [{**ROW, "data": [[[[[[[[[[0.5]]]]]]]]]] * 192}]}).encode(),
        json.dumps({"inputs": [ROW], "parameters": {"priority": {"a": {"b": [1]}}}}).encode(),
        json.dumps({"inputs": [ROW], "id": [[["x"]]]}).encode(),
        # What Triton's parser once answered with 500.
        json.dumps({"inputs": [{**ROW, "shape": [1.0, 3, 8, 8]}]}).encode(),
        json.dumps({"inputs": [{**ROW, "datatype": "fp32"}]}).encode(),
        json.dumps({"inputs": [{**ROW, "data": ["x"] * 192}]}).encode(),
        json.dumps({"inputs": [{**ROW, "data": [1e999] * 192}]}).encode(),
        json.dumps({"inputs": [{**ROW, "data": [0.5] * 191 + [True]}]}).encode(),
        json.dumps({"inputs": [ROW], "outputs": [{"name": "nope"}]}).encode(),
        json.dumps({"inputs": [ROW], "parameters": {"sequence_id": 1}}).encode(),
        json.dumps({"inputs": [ROW], "extra": 1}).encode(),
        json.dumps({"inputs": [{**ROW, "parameters": {"binary_data_size": 1.5}}]}).encode(),
        json.dumps({"inputs": [ROW], "id": "\ud800"}).encode(),
        b'{"inputs": [NaN]}',
        row[:-1],
        b"\xef\xbb\xbf" + row,  # a byte-order mark
        row.decode().encode("utf-16"),
    ]
    for body in bodies:
        status, answer = post(server, body)
        reason = json.loads(answer)["error"]
        assert status == 400 and "\n" not in reason, (body[:80], status, answer)
    # Inference-Header-Content-Length lies.
    for length in ("\u00b2", "\u00b9\u00b2", "-1", "+5", "0x10", "1e3", "10" * 20,
                   str(len(row) + 1), ""):  # fmt: skip
        status, answer = post(server, row, {"Inference-Header-Content-Length": length})
        assert status == 400 and "Inference-Header-Content-Length" in answer.decode(), length
    assert server.ready() and server.running()
    answers_correctly(server)


def test_answers_are_compressed_only_when_the_client_asks(server):
    row = json.dumps({"inputs": [ROW]}).encode()
    for accepted, expected in ((None, None), ("gzip", "gzip"), ("deflate", "deflate"),
                               ("gzip;q=0", None), ("br", None), ("identity", None)):  # fmt: skip
        headers = {"Content-Length": len(row)} | ({"Accept-Encoding": accepted} if accepted else {})
        head = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
        request = f"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\n{head}Connection: close\r\n"
        status, said, answer = exchange(server.http_port, f"{request}\r\n".encode() + row)
        assert status == 200 and said.get("content-encoding") == expected, (accepted, said)
        if expected == "gzip":
            answer = gzip.decompress(answer)
        elif expected == "deflate":
            answer = zlib.decompress(answer)
        scores = json.loads(answer)["outputs"][0]["data"]
        rows = np.full((1, 3, 8, 8), 0.5, np.float32)
        np.testing.assert_allclose(scores, expected_scores(rows)[0], rtol=1e-4, atol=1e-5)


def test_the_limit_is_the_models_inputs_times_its_max_batch_or_the_flags(server, capsys):
    from bladesmith.serve.request_checks import UNBOUNDED_LIMIT, models_of

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


def _as_nobody(server, requests: list[tuple[str, bytes | None]]) -> list[tuple[int, bytes]]:
    """What the server answers each (path, JSON body) POSTed (None: a GET) by another
    user (nobody), from a process of this machine (forked: nobody cannot read this
    Python's files)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            answers = [
                get(server, path) if body is None else post(server, body, path=path)
                for path, body in requests
            ]
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
                    ("/v2/systemsharedmemory/status", None),
                    ("/v2/systemsharedmemory/region/y/register", json.dumps(key).encode()),
                    # The issue's: a `..` once took nobody past the front's check.
                    ("/v2/x/../systemsharedmemory/region/y/register", json.dumps(key).encode()),
                    (f"/v2/systemsharedmemory/region/{names[0]}/unregister", b""),
                    ("/v2/models/net/infer", json.dumps({"inputs": [region_input]}).encode()),
                ])  # fmt: skip
                assert len(answers) == 5, answers
                for k, (status, answer) in enumerate(answers):
                    assert status == 400, answers
                    why = "not a plain path" if k == 2 else "own connections only"
                    assert why in answer, answers
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
                    # The Python backend's own (writing an answer into one crashed Triton).
                    (f"/{regions[0].name}", 16, "the server's own"),
                ):
                    body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
                    status, answer = post(
                        server, body, path="/v2/systemsharedmemory/region/z/register"
                    )
                    assert status == 400 and why in json.loads(answer)["error"], answer
                    message = service_pb2.SystemSharedMemoryRegisterRequest(
                        name="z", key=key, byte_size=size
                    ).SerializeToString()
                    code, details = grpc_call(server, "SystemSharedMemoryRegister", message)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details, details
            finally:
                other.unlink()
    np.testing.assert_allclose(served, expected_scores(row), rtol=1e-4, atol=1e-5)
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


def test_a_client_that_waits_for_100_continue_is_told_to_send_or_refused_unsent(server):
    # curl asks so before a body over 1 MB and waits a second for the answer.
    row = json.dumps({"inputs": [ROW]}).encode()
    for length, expected in ((len(row), b"HTTP/1.1 100 Continue"), (10**9, b"HTTP/1.1 400")):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as connection:
            connection.sendall(
                b"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % length
            )
            assert connection.recv(65536).startswith(expected)
            if length == len(row):
                connection.sendall(row)
                answer = b""
                while chunk := connection.recv(65536):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 200"), answer
