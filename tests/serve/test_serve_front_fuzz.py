"""A seeded fuzz of the request front of `bladesmith serve`, on the real bundled
tritonserver: path tricks, keys given twice, deep nesting, header lies, oversized shapes,
the routes it does not serve, good requests among them, and idle and slow connections,
over HTTP and gRPC. Every request is answered with a 4xx (gRPC: a client error) or
rightly, and after each batch the server is alive, answers, and its processes hold
bounded memory. A flood of connections is refused past the front's limit, without
running out of files or filling the log. One server for the module."""

from __future__ import annotations

import json
import re
import resource
import selectors
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")
import grpc  # noqa: E402
from front_testing import (  # noqa: E402
    CLIENT_ERRORS,
    MAX_BATCH,
    ROW_BYTES,
    answers_correctly,
    exchange,
    expected_scores,
    grpc_call,
    resident_bytes,
    serve_net,
)
from tritonclient.grpc import service_pb2  # noqa: E402

BODY_IDLE_S = IDLE_S = 10.0

# What a batch of attacks may leave each process holding, over what it held before any.
MEMORY_ROOM = 256 << 20
# A connection the server should close is given this long to be closed.
CLOSE_WITHIN_S = max(IDLE_S, BODY_IDLE_S) + 10
GOOD = "good"  # a request that must be answered rightly
SLOW = "slow"  # a connection that must be closed (or answered 408)


@pytest.fixture(scope="module")
def server(net_artifacts, tmp_path_factory):
    log = tmp_path_factory.mktemp("front") / "serve.log"
    with serve_net(net_artifacts[".pt"], log=log) as started:
        yield started


def _send(port: int, data: bytes):
    """The HTTP status the server answers ``data`` with; "closed" where it closed the
    connection without an answer."""
    status, _, _ = exchange(port, data, timeout=CLOSE_WITHIN_S)
    return status or "closed"


def _request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = {"Host": "x", "Connection": "close", "Content-Length": len(body), **(headers or {})}
    lines = "".join(f"{key}: {value}\r\n" for key, value in head.items() if value is not None)
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode("utf-8", "surrogateescape") + body


def _tensor(rows: int = 1, **changes) -> dict:
    """A JSON input tensor of ``rows`` rows of 0.5 (``changes``: keys replaced; a key
    changed to None left out)."""
    tensor = {"name": "input_0", "shape": [rows, 3, 8, 8], "datatype": "FP32"}
    tensor = tensor | {"data": [0.5] * (rows * 192)} | changes
    return {key: value for key, value in tensor.items() if value is not None}


def _body(*tensors, **rest) -> bytes:
    return json.dumps({"inputs": list(tensors), **rest}).encode()


def _held(port: int, first: bytes, trickle: bytes = b"") -> object:
    """Whether the server closes a connection that sends ``first``, then ``trickle`` a
    byte a second: "closed" (or the error status it answered), "held" where it kept
    it."""
    deadline = time.monotonic() + CLOSE_WITHIN_S
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as connection:
        connection.sendall(first)
        sent = 0
        while time.monotonic() < deadline:
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                if sent < len(trickle):
                    try:
                        connection.sendall(trickle[sent : sent + 1])
                    except OSError:
                        return "closed"
                    sent += 1
                continue
            except ConnectionError:
                return "closed"
            if not chunk:
                return "closed"
            status = int(chunk.split(b" ", 2)[1]) if chunk.startswith(b"HTTP/1.1 ") else 200
            if status != 200:
                return status
            # An answer, or gRPC's own frames (its settings, a GOAWAY): still open.
    return "held"


def _attacks(server, seed: int, count: int) -> list[tuple[str, str, object]]:
    """``count`` requests drawn from ``seed``: (kind, expected, send) with expected one
    of "4xx", GOOD or SLOW, and send() the outcome (HTTP status, gRPC code, "closed",
    "held", or for GOOD requests whether the answer was right)."""
    rng = np.random.default_rng(seed)
    http, grpc_port = server.http_port, server.grpc_port

    def pick(options):
        return options[int(rng.integers(len(options)))]

    def huge_shape() -> list:
        return pick([
            [8, 3, 65536, 65536], [int(rng.integers(MAX_BATCH + 1, 2**40)), 3, 8, 8],
            [2**62, 2**62, 3, 8], [int(rng.integers(-(2**40), 0)), 3, 8, 8],
            [1, 3, int(rng.integers(9, 2**20)), 8], [1, 3, 8], [1, 3, 8, 8, 1], [], [0, 3, 8, 8],
        ])  # fmt: skip

    def path_trick():
        route = pick(["/v2/models/net/infer", "/v2/logging", "/v2/repository/index",
                      "/v2/systemsharedmemory/region/s/register", "/v2/models/net/generate",
                      "/v2/trace/setting", "/v2/models/net/config"])  # fmt: skip
        head, _, tail = route.rpartition("/")
        path = pick([
            f"/v2/x/..{route[3:]}", f"/v2/x/%2e%2e{route[3:]}", f"/v2/x/%2E%2E{route[3:]}",
            f"/v2/./{route[4:]}", f"/{route}", f"{head}//{tail}", f"{head}%2F{tail}",
            f"{head}%2f{tail}", f"{route}/", f"{route}?a=b", f"{route}%00", f"{route}/..",
            f"{head}\\{tail}", f"http://x{route}", f"{route};x", "/" + "a/" * 3000 + route,
            f"{head}/%2e/{tail}", route.replace("v2", "V2"), route.replace("net", "n%65t"),
        ])  # fmt: skip
        body = _body(_tensor(data=[1.0], shape=huge_shape()))
        return "4xx", lambda: _send(http, _request(pick(["POST", "GET"]), path, body))

    def keys_twice():
        row = json.dumps(_tensor(), separators=(",", ":"))
        big = json.dumps(huge_shape())
        key, value = pick([("shape", big), ("name", '"other"'), ("datatype", '"FP64"'),
                           ("data", "[1.0]")])  # fmt: skip
        tensor = row.replace(f'"{key}":', f'"{key}":{value},"{key}":', 1)
        body = pick([
            f'{{"inputs":[{tensor}]}}', f'{{"inputs":[{row}],"inputs":[{row}]}}',
            f'{{"inputs":[{row}],"id":"a","id":"a"}}',
            f'{{"inputs":[{row}],"parameters":{{"timeout":1,"timeout":1}}}}',
        ])  # fmt: skip
        return "4xx", lambda: _send(http, _request("POST", "/v2/models/net/infer", body.encode()))

    def nesting():
        depth = int(pick([40, 1000, 20_000, 200_000]))
        body = pick([
            b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth,
            b'{"inputs":[' + b"[" * depth + b"]" * depth + b"]}",
            _body(_tensor(data=[[[[[[[[0.5]]]]]]]] * 192)),
            _body(_tensor(), parameters={"priority": json.loads("[" * 50 + "]" * 50)}),
            b'{"inputs":[' + b'{"name":' * depth + b"1" + b"}" * depth + b"]}",
        ])  # fmt: skip
        return "4xx", lambda: _send(http, _request("POST", "/v2/models/net/infer", body))

    def header_lies():
        body = _body(_tensor())
        binary = _body(_tensor(data=None, parameters={"binary_data_size": ROW_BYTES})).decode()
        length = pick(["\u00b2", "\u00b9\u00b2", "-1", str(-len(binary)), "1" * 30, "0x20", "",
                       str(len(binary) + ROW_BYTES + 1), "1e2", "\u0661\u0662"])  # fmt: skip
        sent = pick([
            _request("POST", "/v2/models/net/infer", binary.encode() + bytes(ROW_BYTES),
                     {"Inference-Header-Content-Length": length}),
            _request("POST", "/v2/models/net/infer", body, {"Content-Length": len(body) // 2}),
            _request("POST", "/v2/models/net/infer", body, {"Content-Length": "-5"}),
            _request("POST", "/v2/models/net/infer", body, {"Content-Length": "1" * 40}),
            _request("POST", "/v2/models/net/infer", body, {"Content-Length": "\u00b2"}),
            _request("POST", "/v2/models/net/infer", body,
                     {"Transfer-Encoding": "chunked"}),
            _request("POST", "/v2/models/net/infer", body, {"Content-Encoding": "gzip"}),
            _request("POST", "/v2/models/net/infer", body, {"Content-Encoding": "br"}),
            b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
            _request("GET", "/v2/health/ready", headers={"X": "a" * 20_000}),
        ])  # fmt: skip
        return "4xx", lambda: _send(http, sent)

    def shapes():
        declared = huge_shape()
        binary = json.dumps({"inputs": [{"name": "input_0", "shape": declared, "datatype": "FP32",
                             "parameters": {"binary_data_size": 16}}]}).encode()  # fmt: skip
        sent = pick([
            _request("POST", "/v2/models/net/infer", _body(_tensor(data=[1.0], shape=declared))),
            _request("POST", "/v2/models/net/infer", binary + bytes(16),
                     {"Inference-Header-Content-Length": len(binary)}),
            _request("POST", "/v2/models/net/infer", _body(_tensor(rows=MAX_BATCH + 1))),
        ])  # fmt: skip
        return "4xx", lambda: _send(http, sent)

    def routes():
        method, path = pick([
            ("POST", "/v2/models/net/generate"), ("POST", "/v2/models/net/generate_stream"),
            ("GET", "/v2/logging"), ("POST", "/v2/logging"), ("GET", "/v2/trace/setting"),
            ("POST", "/v2/trace/setting"), ("POST", "/v2/models/net/trace/setting"),
            ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/net/load"),
            ("POST", "/v2/repository/models/net/unload"),
            ("POST", "/v2/systemsharedmemory/region/r/register"),
            ("POST", "/v2/cudasharedmemory/region/r/register"),
            ("POST", "/v2/systemsharedmemory/status"), ("PUT", "/v2/models/net/infer"),
            ("GET", "/v2/models/other/config"), ("POST", "/v2/models/other/infer"),
        ])  # fmt: skip
        body = pick([
            b"{}", b'{"key": "/../../etc/passwd", "byte_size": 10}', b'{"log_info": 0}',
            b'{"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8}',
        ])  # fmt: skip
        return "4xx", lambda: _send(http, _request(method, path, body))

    def grpc_calls():
        request = service_pb2.ModelInferRequest(model_name=pick(["net", "other", "../net", ""]))
        tensor = request.inputs.add(name=pick(["input_0", "x"]), datatype=pick(["FP32", "FP64"]))
        tensor.shape.extend(pick([huge_shape(), [1, 3, 8, 8]]))
        if rng.integers(2):
            request.raw_input_contents.append(bytes(int(rng.integers(0, 2 * ROW_BYTES))))
        if rng.integers(4) == 0:
            request.parameters["sequence_id"].int64_param = 1
        good = service_pb2.ModelInferRequest(model_name="net")
        good.inputs.add(name="input_0", datatype="FP32", shape=[1, 3, 8, 8])
        good.raw_input_contents.append(bytes(ROW_BYTES))
        method, message = pick([
            ("ModelInfer", request.SerializeToString()),
            # Two messages in one: protobuf merges them (two inputs of one name).
            ("ModelInfer", good.SerializeToString() + good.SerializeToString()),
            ("ModelInfer", bytes(rng.integers(0, 256, int(rng.integers(1, 200)), np.uint8))),
            ("RepositoryModelUnload", b"\n\x03net"), ("LogSettings", b""), ("TraceSetting", b""),
            ("RepositoryIndex", b""), ("SystemSharedMemoryRegister", b"\n\x01x\x12\x05/../x"),
            ("CudaSharedMemoryRegister", b"\n\x01x\x12\x04AAAA"),
            ("ModelConfig", b"\n\x05other"), ("ModelMetadata", b"\n\x02.."),
        ])  # fmt: skip
        return "4xx", lambda: grpc_call(server, method, message)[0]

    def slow():
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
        port, first, trickle = pick([
            (http, b"", b""),  # connects, says nothing
            (http, b"GET /v2/health/ready HTTP/1.1\r\n", b"Host: xxxxxxxxxxxxxxxxxxxxxxxxxxx"),
            (http, _request("POST", "/v2/models/net/infer", headers={"Content-Length": 900,
                                                                     "Connection": None}), b""),
            (http, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", b""),  # then idle
            (grpc_port, b"", b""),
            (grpc_port, preface, b""),  # a gRPC connection that never calls
        ])  # fmt: skip
        return SLOW, lambda: _held(port, first, trickle)

    def good():
        rows = int(rng.integers(1, MAX_BATCH + 1))
        x = rng.standard_normal((rows, 3, 8, 8), dtype=np.float32)
        over, nested = pick(["json", "binary", "grpc"]), bool(rng.integers(2))
        expected = expected_scores(x)  # here: tiny_net() seeds torch's global generator

        def send():
            if over == "grpc":
                request = service_pb2.ModelInferRequest(model_name="net")
                request.inputs.add(name="input_0", datatype="FP32", shape=list(x.shape))
                request.raw_input_contents.append(x.tobytes())
                with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                    answer = service_pb2.ModelInferResponse.FromString(
                        call(request.SerializeToString(), timeout=60)
                    )
                scores = np.frombuffer(answer.raw_output_contents[0], np.float32)
            else:
                header = {"name": "input_0", "shape": list(x.shape), "datatype": "FP32"}
                if over == "json":  # flat or nested as the shape
                    data = x.tolist() if nested else x.ravel().tolist()
                    body, extra = _body({**header, "data": data}), {}
                else:
                    part = _body({**header, "parameters": {"binary_data_size": x.nbytes}})
                    body = part + x.tobytes()
                    extra = {"Inference-Header-Content-Length": len(part)}
                status, _, answer = exchange(
                    http, _request("POST", "/v2/models/net/infer", body, extra)
                )
                if status != 200:
                    return status
                scores = np.array(json.loads(answer)["outputs"][0]["data"], np.float32)
            scores = scores.reshape(rows, 5)
            if np.allclose(scores, expected, rtol=1e-4, atol=1e-5):
                return True
            return f"{over}: {rows} rows, off by {np.abs(scores - expected).max():.3g}"

        return GOOD, send

    makers = [path_trick, keys_twice, nesting, header_lies, shapes, routes, grpc_calls, good]
    attacks = []
    for k in range(count):
        maker = slow if k % 25 == 0 else makers[k % len(makers)]
        expected, send = maker()
        attacks.append((maker.__name__, expected, send))
    return attacks


def _judged(kind: str, expected: str, outcome) -> bool:
    if expected == GOOD:
        return outcome is True
    if expected == SLOW:
        return outcome in ("closed", 408)
    return (isinstance(outcome, int) and 400 <= outcome < 500) or outcome in CLIENT_ERRORS


def _batches(server, seed: int, batches: int, count: int) -> None:
    """``batches`` of ``count`` attacks sent 32 at a time; after each, every outcome is
    a 4xx or right, the server answers, and no process of it grew past MEMORY_ROOM."""
    baseline = resident_bytes(server)
    for batch in range(batches):
        attacks = _attacks(server, seed + batch, count)
        with ThreadPoolExecutor(32) as pool:
            outcomes = list(pool.map(lambda attack: attack[2](), attacks))
        wrong = [
            (kind, outcome)
            for (kind, expected, _), outcome in zip(attacks, outcomes)
            if not _judged(kind, expected, outcome)
        ]
        assert not wrong, f"batch {batch}: {len(wrong)} of {count} wrong: {wrong[:10]}"
        kinds = {kind for kind, _, _ in attacks}
        assert len(kinds) == 9, kinds
        assert server.ready() and server.running()
        answers_correctly(server)
        held = resident_bytes(server)
        grown = {name: held[name] - baseline[name] for name in held}
        assert all(size < MEMORY_ROOM for size in grown.values()), (batch, grown)
    log = server.log.read_text(errors="replace")
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]


def test_a_fuzz_of_attacks_is_answered_with_4xx_or_rightly_and_the_server_holds(server):
    _batches(server, seed=43, batches=1, count=250)


@pytest.mark.slow
def test_a_long_fuzz_of_attacks_leaves_the_server_answering_with_bounded_memory(server):
    _batches(server, seed=4300, batches=8, count=500)


def _closed(connections: list, wait: float) -> list:
    """Those of ``connections`` that the server closes within ``wait`` seconds (what they
    are sent before is read: an HTTP 503, gRPC's settings)."""
    closed, open_ = [], set(connections)
    deadline = time.monotonic() + wait
    with selectors.DefaultSelector() as selector:
        for connection in connections:
            selector.register(connection, selectors.EVENT_READ)
        while open_ and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                try:
                    said = key.fileobj.recv(65536)
                except ConnectionError:
                    said = b""
                if said.startswith(b"HTTP/1.1 "):
                    assert said.startswith(b"HTTP/1.1 503"), said
                if not said:
                    selector.unregister(key.fileobj)
                    open_.discard(key.fileobj)
                    closed.append(key.fileobj)
    return closed


def test_a_flood_of_connections_is_refused_past_the_limit_and_idle_ones_are_closed(server):
    limit = int(re.search(r"at most (\d+) connections each", server.log.read_text()).group(1))
    wanted = 2 * (limit + 100) + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    held = []
    try:
        for port in (server.http_port, server.grpc_port):
            flood, opened = [], []
            for _ in range(limit + 50):
                flood.append(socket.create_connection(("127.0.0.1", port), 5))
                opened.append(time.monotonic())
            held += flood
            # Those past the limit are closed at once (HTTP: answered 503 first). A flood
            # slowed by the listen backlog (a busy machine) lets the idle timeout close
            # its first connections meanwhile, making room for as many later ones: those
            # aged past IDLE_S may be closed too, and no connection more.
            closed = _closed(flood, 1.0)
            aged = sum(time.monotonic() - at > IDLE_S - 1.0 for at in opened)
            took = f"port {port}: flood of {len(flood)} in {opened[-1] - opened[0]:.1f} s"
            assert 50 <= len(closed) <= 50 + aged, (len(closed), aged, took)
            fresh = time.monotonic() - opened[0] < IDLE_S - 2.0
            if port == server.http_port and fresh:  # while it is reached, a new one is told so
                assert _send(server.http_port, _request("GET", "/v2/health/ready")) == 503
        # Idle, each is closed within IDLE_S (gRPC: its handshake's timeout).
        assert len(_closed(held, CLOSE_WITHIN_S)) == len(held)
    finally:
        for connection in held:
            connection.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert server.ready() and server.running()
    answers_correctly(server)
    log = server.log.read_text(errors="replace")
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]
