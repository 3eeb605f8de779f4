"""`bladesmith serve` on loopback: real Triton, real requests through tritonclient, bad
requests answered with errors, clean shutdown. Everything started here is stopped here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")
import tritonclient.http as triton  # noqa: E402
from serve_testing import NET_BATCH, QUICK, free_ports, tiny_net, typed_inputs  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

import bladesmith  # noqa: E402
from bladesmith.cli import main  # noqa: E402

MAX_BATCH = 8
STARTUP_S = 300


def _environment() -> dict[str, str]:
    source = str(Path(bladesmith.__file__).parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([source, *sys.path])}


def _wait_ready(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"bladesmith serve exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"not ready after {STARTUP_S} s:\n{log.read_text()[-3000:]}")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _tritonservers(pid: int) -> list[int]:
    """The tritonserver children of ``pid`` (its other child is the request front)."""
    found = []
    for child in _children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if command.split(b"\0")[0].endswith(b"tritonserver"):
            found.append(child)
    return found


def started_serve(artifact: Path, log: Path, *options: str):
    """`bladesmith serve ARTIFACT OPTIONS` started on free ports, its output in ``log``:
    (process, http, grpc and metrics ports), not yet ready."""
    http, grpc, metrics = free_ports(3)
    command = [
        sys.executable, "-m", "bladesmith", "serve", str(artifact),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        *(["--trust"] if artifact.suffix in (".pt2", ".ptc") else []),  # compiled code runs
        *options,
    ]  # fmt: skip
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=_environment()
        )
    return process, http, grpc, metrics


@contextmanager
def _serving(artifact: Path, log: Path, *options: str):
    """`bladesmith serve ARTIFACT OPTIONS` as a user runs it, ready: (process, http, grpc
    and metrics ports); SIGTERM (then SIGKILL) on exit if it still runs."""
    process, http, grpc, metrics = started_serve(artifact, log, *options)
    try:
        _wait_ready(http, process, log)
        yield process, http, grpc, metrics
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()  # its tritonserver gets SIGTERM when it dies
                process.wait()


@pytest.fixture
def served_net(net_artifacts, tmp_path):
    """`bladesmith serve net.pt`, two instances: (process, http, grpc and metrics ports)."""
    options = (
        "--max-batch", str(MAX_BATCH), "--max-queue-delay-us", "2000", "--instances", "2",
        "--shared-memory",
    )  # fmt: skip
    with _serving(net_artifacts[".pt"], tmp_path / "serve.log", *options) as served:
        yield served


def _request(client, x: np.ndarray, dtype: str = "FP32"):
    tensor = triton.InferInput("input_0", list(x.shape), dtype)
    tensor.set_data_from_numpy(x)
    return client.infer("net", [tensor])


def test_serve_answers_concurrent_requests_refuses_bad_ones_and_stops_cleanly(served_net, tmp_path):
    process, http, grpc, metrics = served_net
    url = f"127.0.0.1:{http}"
    generator = np.random.default_rng(0)
    requests = [
        generator.standard_normal((1 + i % 3, 3, 8, 8), dtype=np.float32) for i in range(300)
    ]
    local = threading.local()
    clients = []

    def send(x):
        if not hasattr(local, "client"):
            local.client = triton.InferenceServerClient(url)
            clients.append(local.client)
        result = _request(local.client, x)
        return result.as_numpy("output_0"), result.as_numpy("output_1")

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, requests))
    for client in clients:
        client.close()
    reference = tiny_net()
    for x, (scores, best) in zip(requests, answers):
        with torch.no_grad():
            expected_scores, expected_best = reference(torch.from_numpy(x))
        np.testing.assert_allclose(scores, expected_scores.numpy(), rtol=1e-4, atol=1e-5)
        assert best.dtype == np.int64 and best.shape == (len(x), 1)
        np.testing.assert_array_equal(best[:, 0], expected_best.numpy())

    client = triton.InferenceServerClient(url)
    good = requests[0]
    nan = good.copy()
    nan[0, 0, 0, 0] = np.nan
    bad = [
        (good[:, :, :4], "expected shape"),
        (good.astype(np.float64), "FP64"),
        (np.zeros((MAX_BATCH + 1, 3, 8, 8), np.float32), "--max-request-bytes"),
        (nan, "non-finite values"),
    ]
    for x, reason in bad:
        dtype = "FP64" if x.dtype == np.float64 else "FP32"
        with pytest.raises(InferenceServerException, match=reason) as refused:
            _request(client, x, dtype)
        assert refused.value.status() == "400", (reason, refused.value.status())  # the client's
        assert client.is_server_ready() and client.is_model_ready("net")
    empty = urllib.request.Request(f"http://{url}/v2/models/net/infer", data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(empty, timeout=10)
    assert refused.value.code == 400
    assert client.is_server_live() and client.is_server_ready()
    np.testing.assert_allclose(
        _request(client, good).as_numpy("output_0"), answers[0][0], rtol=1e-5, atol=1e-6
    )
    client.close()

    report = tmp_path / "loadtest.json"
    arguments = ["loadtest", url, "--concurrency", "1,8", "--requests", "40", "--json", str(report)]
    assert main(arguments) == 0
    found = json.loads(report.read_text())
    rows = [(r["concurrency"], r["answered"], r["wrong"], r["failed"]) for r in found]
    assert rows == [(1, 40, 0, 0), (8, 40, 0, 0)]
    # The server's own account: one row per execution when requests come one at a time.
    assert found[0]["batch"] == 1.0 and found[1]["batch"] >= 1.0
    assert all(r["compute_ms"] > 0 and r["queue_ms"] >= 0 for r in found)
    with bladesmith.client(url, "net") as over_http:
        with bladesmith.client(f"grpc://127.0.0.1:{grpc}", "net") as over_grpc:
            totals = over_http.statistics()
            assert over_grpc.statistics() == totals
    assert totals.requests >= len(requests) + 2 * 40 and totals.executions <= totals.requests
    # Over gRPC, the model found on the server as over HTTP (it once needed --model).
    assert (
        main(["loadtest", f"grpc://127.0.0.1:{grpc}", "--concurrency", "2", "--requests", "8"]) == 0
    )
    # The same through shared memory: answered alike, and every region freed after.
    assert main([*arguments[:-2], "--shared-memory"]) == 0
    client = triton.InferenceServerClient(url)
    assert client.get_system_shared_memory_status() == []
    client.close()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("bladesmith-")]

    # Each instance says its buckets: the net runs at any batch up to its own.
    assert (tmp_path / "serve.log").read_text().count("batch buckets 1, 2, 4\n") == 2

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as page:
        text = page.read().decode()
    success = next(
        line for line in text.splitlines() if line.startswith("nv_inference_request_success")
    )
    assert float(success.split()[-1]) >= len(requests) + 1 + 40 * 4

    servers = _children(process.pid)
    assert servers, "no tritonserver child"
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0
    for pid in servers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.mark.slow
def test_serve_detector_answers_each_image_with_its_own_detections(detector_artifact):
    from bladesmith.verify import compare_detections

    path, photos = detector_artifact
    http, grpc, metrics = free_ports(3)
    loaded = bladesmith.load(path)
    generator = torch.Generator().manual_seed(0)
    images = [photos[0]] + [
        (photos[0] + 0.2 * torch.rand(photos[0].shape, generator=generator)).clamp(0, 1)
        for _ in range(3)
    ]
    server = bladesmith.serve(
        path,
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        instances=2,
        block=False,
    )
    try:
        detect = bladesmith.client(server.url, "detector")
        assert detect.detections and detect.max_batch == 1
        expected = [loaded([image])[0] for image in images]

        def ask(image):  # a client per thread, as tritonclient's HTTP client needs
            with bladesmith.client(server.url, "detector") as client:
                return client([image])[0]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, images))
        for want, answer in zip(expected, got):
            assert set(answer) == {"boxes", "scores", "labels"}
            comparison = compare_detections([want], [answer])
            assert comparison.passed, comparison.summary()
        assert len({len(answer["scores"]) for answer in got} | {0}) > 1  # found something
        with bladesmith.client(server.grpc_url, "detector") as over_grpc:
            assert compare_detections(expected[:1], over_grpc(images[:1])).passed
        detect.close()

        # Shutdown while a request is in flight: it is answered first.
        def late():
            with bladesmith.client(server.url, "detector") as client:
                return client(images[1:2])

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(late)
            time.sleep(0.5)
            assert server.stop() == 0
            assert compare_detections(expected[1:2], pending.result(timeout=60)).passed
    finally:
        server.stop()


@pytest.mark.slow
def test_a_detector_served_as_uint8_answers_a_float_image_and_a_load_test(detector_artifact):
    from bladesmith.serve.loadtest import loadtest
    from bladesmith.verify import compare_detections

    path, photos = detector_artifact
    http, grpc, metrics = free_ports(3)
    quantized = (photos[0] * 255).round() / 255  # what a uint8 image holds
    expected = bladesmith.load(path)([quantized])
    with bladesmith.serve(
        path, http_port=http, grpc_port=grpc, metrics_port=metrics, image_dtype="uint8", block=False
    ) as server:
        with bladesmith.client(server.url, "detector") as detect:
            assert detect.inputs[0][1] == "UINT8"
            assert detect.compute_dtype == bladesmith.load(path).spec.dtype
            comparison = compare_detections(expected, detect([photos[0]]))  # float32 given
            assert comparison.passed and comparison.matched > 0, comparison.summary()
        # From two processes, two threads each, started together.
        [row] = loadtest(server.url, concurrency=(4,), requests=12, processes=2)
        assert (row.answered, row.wrong, row.failed) == (12, 0, 0)


@pytest.mark.slow
def test_a_compiled_program_is_served_from_its_compiled_code_under_trust(tmp_path):
    """A .ptc (Inductor's kernels, the speed the report gives) is served: refused in one
    line without --trust, since loading runs the code it brings; with it, each instance
    answers as the result in process does, over HTTP and gRPC."""
    from bladesmith.errors import BladesmithError
    from bladesmith.passes.inductor import Inductor
    from bladesmith.serve.loadtest import loadtest
    from engine_testing import Wasteful

    x = torch.randn(NET_BATCH, 3, 8, 8)
    optimized, spec, _ = bladesmith.optimize(
        Wasteful(tiny_net()), "o2", device="cpu", test_data=[(x,)], config=QUICK,
        passes=[Inductor()],
    )  # fmt: skip
    assert spec.passes == ("inductor",) and ".ptc" in spec.save_formats, spec
    path = bladesmith.save(optimized, tmp_path / "net.ptc")
    with torch.no_grad():
        expected = [each.numpy() for each in optimized(x)]
    http, grpc, metrics = free_ports(3)
    ports = {"http_port": http, "grpc_port": grpc, "metrics_port": metrics}
    with pytest.raises(BladesmithError, match="--trust"):
        bladesmith.serve(path, block=False, **ports)
    with bladesmith.serve(path, block=False, trust=True, instances=2, **ports) as server:
        with bladesmith.client(server.url, "net") as run:
            answers = run(x.numpy())
        for row, answer in enumerate(answers):
            for k, name in enumerate(("output_0", "output_1")):
                np.testing.assert_allclose(answer[name], expected[k][row], rtol=1e-4, atol=1e-5)
        [row] = loadtest(server.grpc_url, concurrency=(4,), requests=24)
        assert (row.answered, row.wrong, row.failed) == (24, 0, 0)


@pytest.mark.slow
def test_a_mask_rcnn_is_served_with_its_masks_and_load_tested_on_them(mask_artifact):
    from bladesmith.serve.loadtest import loadtest
    from bladesmith.verify import compare_detections

    path, photos = mask_artifact
    http, grpc, metrics = free_ports(3)
    expected = bladesmith.load(path)(list(photos))
    with bladesmith.serve(
        path, http_port=http, grpc_port=grpc, metrics_port=metrics, block=False
    ) as server:
        with bladesmith.client(server.url, "mask") as segment:
            assert segment.detections and segment.max_batch == 2
            got = segment(photos)
        assert [set(answer) for answer in got] == [{"boxes", "scores", "labels", "masks"}] * 2
        comparison = compare_detections(expected, got)
        assert comparison.passed and comparison.fields["masks"].deviation is not None
        # Its test rows are views of photographs, each answer's masks judged too.
        [row] = loadtest(server.url, concurrency=(4,), requests=16)
        assert (row.answered, row.wrong, row.failed) == (16, 0, 0)


def test_serve_loads_the_operator_libraries_saved_beside_the_artifact(user_op_artifact):
    # No --load-library: each model instance, a process of its own, loads scaled.pt.libs/
    # as bladesmith.load does anywhere.
    path, model = user_op_artifact
    http, grpc, metrics = free_ports(3)
    x = np.random.default_rng(0).standard_normal((3, 6), dtype=np.float32)
    # Its library is native code: each model instance loads it under the trust given.
    with bladesmith.serve(
        path, http_port=http, grpc_port=grpc, metrics_port=metrics, block=False, trust=True
    ) as server:
        with bladesmith.client(server.url, "scaled") as client:
            answers = client(x)
    got = torch.stack([answer["output_0"] for answer in answers])
    torch.testing.assert_close(got, model(torch.from_numpy(x)))


@pytest.mark.parametrize("name", ["tagger.pt", "laststep.pt"])
def test_inputs_of_other_dtypes_are_served_answered_and_load_tested(typed_artifacts, name):
    # int64 token ids and a float32 mask; float64 rows and an int64 length per row.
    from bladesmith.serve.loadtest import loadtest

    path, model = typed_artifacts[name]
    http, grpc, metrics = free_ports(3)
    first, second = typed_inputs(model, rows=3, seed=2)
    if first.dtype == torch.int64:
        first = first.int()  # the client casts int32 ids to the served int64
    with bladesmith.serve(
        path, http_port=http, grpc_port=grpc, metrics_port=metrics, block=False
    ) as server:
        with bladesmith.client(server.url, path.stem) as client:
            assert [datatype for _, datatype, _ in client.inputs] == (
                ["INT64", "FP32"] if name == "tagger.pt" else ["FP64", "INT64"]
            )
            answers = client(first, second)
        # Each row its own random ids (within the test data's) or values: a row's answer
        # is another's only when mixed up.
        [row] = loadtest(server.url, concurrency=(4,), requests=24)
        assert (row.answered, row.wrong, row.failed) == (24, 0, 0)
    with torch.no_grad():
        expected = model(first.long() if first.dtype == torch.int32 else first, second)
    got = torch.stack([answer["output_0"] for answer in answers])
    torch.testing.assert_close(got, expected)


def test_serve_says_in_one_line_what_is_wrong(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing.pt2")]) == 2
    err = capsys.readouterr().err
    assert ": error: " in err and "missing.pt2" in err and len(err.splitlines()) == 1
    # A plain ONNX file (`bladesmith export onnx` writes them): what to do instead.
    import onnx
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "plain",
        [value("x", TensorProto.FLOAT, [1, 4])],
        [value("y", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "plain.onnx"))
    http, grpc, metrics = free_ports(3)
    ports = ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    assert main(["serve", str(tmp_path / "plain.onnx"), *ports]) == 2
    err = capsys.readouterr().err
    assert "plain.onnx was not written by bladesmith.save" in err and len(err.splitlines()) == 1
    assert "optimize MODEL --out plain.onnx" in err and "export triton plain.onnx" in err
    # The advice works: Triton's onnxruntime backend takes the file as it is.
    advice = ["export", "triton", str(tmp_path / "plain.onnx"), str(tmp_path / "repo")]
    assert main([*advice, "--backend", "onnxruntime"]) == 0
    # A plain TorchScript file: no Triton route is offered, as none takes it.
    torch.jit.save(torch.jit.script(torch.nn.ReLU()), str(tmp_path / "plain.pt"))
    assert main(["serve", str(tmp_path / "plain.pt"), *ports]) == 2
    err = capsys.readouterr().err
    assert "optimize MODEL --out plain.pt" in err and "export triton" not in err


def test_loadtest_of_a_server_that_is_not_there_says_so_in_one_line(capsys):
    [port] = free_ports(1)
    for named in ([], ["--model", "m"]):  # the model found on the server, or named
        assert main(["loadtest", f"localhost:{port}", *named]) == 2
        err = capsys.readouterr().err
        assert "cannot reach" in err and f"localhost:{port}" in err and len(err.splitlines()) == 1


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _group(pgid: int) -> list[int]:
    from bladesmith.serve.server import _group_members

    return _group_members(pgid)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_signalled_mid_load_answers_or_refuses_each_request_and_leaves_nothing(
    net_artifacts, tmp_path, signum
):
    from http.client import HTTPConnection

    http, grpc, metrics = free_ports(3)
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "bladesmith", "serve", str(net_artifacts[".pt"]),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        "--instances", "2",
    ]  # fmt: skip
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=_environment()
        )
    stop_sending = threading.Event()
    outcomes: list[str] = []
    reference = tiny_net()

    def send(seed: int) -> None:  # one client per thread; bounded by time and count
        generator = np.random.default_rng(seed)
        protocol, client = _client_of(seed, http, grpc)
        try:
            for _ in range(5000):
                if stop_sending.is_set():
                    return
                x = generator.standard_normal((1, 3, 8, 8), dtype=np.float32)
                tensor = protocol.InferInput("input_0", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                try:
                    scores = client.infer("net", [tensor]).as_numpy("output_0")
                except InferenceServerException as error:
                    # Refused as unavailable, to be sent again: never "unknown model" (404).
                    if "shutting down" in error.message():
                        assert error.status() in ("503", "StatusCode.UNAVAILABLE"), error
                        outcomes.append(f"refused {protocol.__name__}")
                        continue
                    # gRPC's word for a connection closed or refused.
                    assert error.status() in ("StatusCode.UNAVAILABLE", "StatusCode.CANCELLED")
                    assert "not found" not in error.message().lower(), error
                    outcomes.append("closed")
                    return
                except Exception as error:  # noqa: BLE001 - closed or refused connections
                    assert isinstance(error, OSError) or "closed" in str(error), repr(error)
                    outcomes.append("closed")
                    return
                with torch.no_grad():
                    expected = reference(torch.from_numpy(x))[0].numpy()
                np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
                outcomes.append("answered")
        finally:
            client.close()

    idle = None
    try:
        _wait_ready(http, process, log)
        tritonserver = _tritonservers(process.pid)
        assert len(tritonserver) == 1 and len(_children(process.pid)) == 2  # and the front
        stubs = _group(tritonserver[0])
        assert len(stubs) >= 3, stubs  # tritonserver and its two instances' stubs
        # An idle keep-alive connection, which once held the exit up for 30 s.
        idle = http_client = HTTPConnection("127.0.0.1", http, timeout=60)
        http_client.request("GET", "/v2/health/ready")
        assert http_client.getresponse().read() == b""
        with ThreadPoolExecutor(8) as pool:
            senders = [pool.submit(send, seed) for seed in range(8)]
            time.sleep(3)
            answered_before = outcomes.count("answered")
            assert answered_before > 0
            signalled = time.monotonic()
            process.send_signal(signum)
            code = process.wait(60)
            took = time.monotonic() - signalled
            stop_sending.set()
            for sender in senders:
                sender.result(timeout=120)  # raises what a sender found wrong
    finally:
        stop_sending.set()
        if idle is not None:
            idle.close()
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert took < 30, took
    assert "Signal (11)" not in text and "Exit timeout expired" not in text
    # It listened where it said: loopback only (the default --host).
    assert f"serving net: http 127.0.0.1:{http}, grpc grpc://127.0.0.1:{grpc}" in text
    # The front, there; tritonserver on its Unix sockets only.
    assert f"request front on 127.0.0.1: http {http}, grpc {grpc}" in text
    assert (
        "Started HTTPService at unix:" in text and "Started GRPCInferenceService at unix:" in text
    )
    assert {"refused tritonclient.http", "refused tritonclient.grpc"} <= set(outcomes)
    assert not _group(tritonserver[0]), "a tritonserver or stub process survived"
    assert all(_port_free(port) for port in (http, grpc, metrics))
    leaked = [name for name in os.listdir("/dev/shm") if f"_{process.pid}_" in name]
    assert not leaked


def _client_of(number: int, http: int, grpc: int):
    """(tritonclient's protocol module, a client of it): HTTP for even ``number``s,
    gRPC for odd ones, so that half of a test's clients use each."""
    import tritonclient.grpc as triton_grpc

    if number % 2:
        return triton_grpc, triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc}")
    return triton, triton.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=60)


SPIN_STEPS = 500  # tens of milliseconds a request here: requests queue behind one another


def _spin(protocol, client, x: np.ndarray, steps: int) -> np.ndarray:
    """Spin's answer to rows ``x`` run ``steps`` times, over tritonclient's ``protocol``."""
    rows = protocol.InferInput("input_0", list(x.shape), "FP32")
    rows.set_data_from_numpy(x)
    counts = protocol.InferInput("input_1", [len(x), 1], "INT64")
    counts.set_data_from_numpy(np.full((len(x), 1), steps, np.int64))
    return client.infer("spin", [rows, counts]).as_numpy("output_0")


@pytest.mark.slow
def test_a_stop_answers_the_requests_that_had_arrived_and_refuses_later_ones(
    spin_artifact, tmp_path
):
    from serve_testing import Spin

    log = tmp_path / "serve.log"
    senders, latecomers = 12, 6
    rows = np.random.default_rng(0).standard_normal((senders + latecomers, 1, 16), np.float32)
    hold, late = threading.Event(), threading.Event()
    lock = threading.Lock()
    in_flight = [0]
    before, after = [], []  # (row, answer or "refused")

    def ask(index: int, ready: threading.Event | None = None) -> str | np.ndarray:
        """Row ``index``'s answer or "refused", sent once ``ready`` is set."""
        protocol, client = _client_of(index, http, grpc)
        try:
            if ready is not None:
                ready.wait(60)
            return _spin(protocol, client, rows[index], SPIN_STEPS)
        except InferenceServerException as error:
            assert "shutting down" in error.message(), error  # nothing else
            assert error.status() in ("503", "StatusCode.UNAVAILABLE"), error
            return "refused"
        finally:
            client.close()

    def send(index: int) -> None:
        while not hold.is_set():
            with lock:
                in_flight[0] += 1
            answer = ask(index)
            with lock:
                in_flight[0] -= 1
                before.append((index, answer))

    def send_late(index: int) -> None:
        after.append((index, ask(index, ready=late)))

    with _serving(spin_artifact, log, "--max-batch", "1") as (process, http, grpc, _):
        [tritonserver] = _tritonservers(process.pid)
        for _ in range(3):  # TorchScript's profiling runs: slow
            ask(0)
        with ThreadPoolExecutor(senders + latecomers) as pool:
            sending = [pool.submit(send, index) for index in range(senders)]
            sending += [pool.submit(send_late, senders + i) for i in range(latecomers)]
            try:
                time.sleep(1)
                hold.set()  # no more requests: those in flight have all arrived 0.1 s later
                time.sleep(0.1)
                with lock:
                    arrived = in_flight[0]
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                time.sleep(0.2)
            finally:
                hold.set()
                late.set()  # sent once the stop has begun
            for each in sending:
                each.result(timeout=60)  # raises what a sender found wrong
            code = process.wait(60)
            took = time.monotonic() - signalled
    text = log.read_text()
    assert code == 0 and took < 30, text[-3000:]
    assert arrived >= 3, arrived  # one computed, the others queued behind it: else no test
    refused_early = [index for index, answer in before if isinstance(answer, str)]
    assert not refused_early, f"{len(refused_early)} of {len(before)} that had arrived refused"
    with torch.no_grad():
        expected = Spin().eval()(torch.from_numpy(rows[:, 0]), torch.tensor([SPIN_STEPS]))
    for index, answer in before + [(i, a) for i, a in after if not isinstance(a, str)]:
        np.testing.assert_allclose(answer[0], expected[index].numpy(), rtol=1e-4, atol=1e-5)
    # Later requests are refused, but for the stop's margin: two batches per instance (of
    # one request here) that may be numbered before the cutoff.
    refused = sum(isinstance(answer, str) for _, answer in after)
    assert len(after) == latecomers and refused >= latecomers - 2, refused
    assert not _group(tritonserver), "a tritonserver or stub process survived"


@pytest.mark.slow
def test_a_second_signal_ends_the_stop_at_once_and_says_requests_may_be_cut_off(
    spin_artifact, tmp_path
):
    log = tmp_path / "serve.log"
    row = np.zeros((1, 16), np.float32)
    with _serving(spin_artifact, log, "--max-batch", "1") as (process, http, _, _):
        [tritonserver] = _tritonservers(process.pid)
        client = triton.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=120)
        with ThreadPoolExecutor(1) as pool:
            # Minutes of computing: the batch outlasts the drain's 30 s.
            computing = pool.submit(_spin, triton, client, row, 10**6)
            time.sleep(1)
            process.send_signal(signal.SIGTERM)
            time.sleep(1)
            assert process.poll() is None  # waiting for the batch
            signalled = time.monotonic()
            process.send_signal(signal.SIGINT)
            code = process.wait(30)
            took = time.monotonic() - signalled
            assert computing.exception(timeout=30) is not None  # cut off
        client.close()
    said = [
        line for line in log.read_text().splitlines() if line.startswith("bladesmith serve: error")
    ]
    assert code == 1 and took < 10, said
    assert len(said) == 1 and "second signal" in said[0] and "may have been cut off" in said[0]
    assert not _group(tritonserver), "a tritonserver or stub process survived"
    assert not [name for name in os.listdir("/dev/shm") if f"_{process.pid}_" in name]


def test_a_tritonserver_that_dies_leaves_no_stub_or_shared_memory_and_says_so(net_artifacts):
    from bladesmith.serve.server import _group_members

    http, grpc, metrics = free_ports(3)
    server = bladesmith.serve(
        net_artifacts[".pt"],
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        instances=2,
        block=False,
    )
    try:
        pid = server._process.pid
        regions = [name for name in os.listdir("/dev/shm") if name.startswith(server._shm_prefix)]
        assert regions and len(_group_members(pid)) >= 3
        os.kill(pid, signal.SIGKILL)  # as a crash: its stubs are left running
        deadline = time.monotonic() + 30
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group_members(pid), "the stubs did not outlive their server"
    finally:
        code = server.stop()
    assert code == -signal.SIGKILL and "killed" in server.stop_problem
    assert not _group_members(pid)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(server._shm_prefix)]
    assert all(_port_free(port) for port in (http, grpc, metrics))


def test_a_stop_whose_work_folder_was_removed_still_ends_tritonserver(net_artifacts):
    """A /tmp cleaner may remove the folder the stop signals through: the stop says it
    could not drain, and still ends tritonserver and its stubs."""
    from bladesmith.serve.server import _group_members

    http, grpc, metrics = free_ports(3)
    server = bladesmith.serve(
        net_artifacts[".pt"], http_port=http, grpc_port=grpc, metrics_port=metrics, block=False
    )
    pid = server._process.pid
    shutil.rmtree(server._workdir.name)
    code = server.stop()
    assert code == 0 and "could not drain" in server.stop_problem
    assert not _group_members(pid)
    assert all(_port_free(port) for port in (http, grpc, metrics))


def test_the_locks_tritonserver_shows_local_users_open_nothing_through_the_front(
    net_artifacts,
):
    # /proc/PID/cmdline (ps) is every local user's to read: the header values of
    # --http-restricted-api and --grpc-restricted-protocol are theirs too. They open
    # nothing: tritonserver's sockets are the serving user's alone, and the front passes
    # on no header or metadata of a client's, nor the routes they lock.
    import tritonclient.grpc as triton_grpc

    http, grpc, metrics = free_ports(3)
    with bladesmith.serve(
        net_artifacts[".pt"], http_port=http, grpc_port=grpc, metrics_port=metrics, block=False
    ) as server:
        command = Path(f"/proc/{server._process.pid}/cmdline").read_bytes().decode().split("\0")
        assert "model-control-mode" not in " ".join(command)
        locks = [flag.split("=", 1)[1] for flag in command if "restricted" in flag]
        # Shared memory is off: locked with the rest (no header is given to the front).
        assert len(locks) == 2 and all(
            lock.startswith("model-repository,trace,logging,shared-memory:") for lock in locks
        ), locks
        header, value = locks[0].split(":", 1)[1].split("=", 1)
        # Nobody loads or unloads a model: over HTTP, over gRPC, with the header.
        for call in ("unload", "load"):
            refused = urllib.request.Request(
                f"http://127.0.0.1:{http}/v2/repository/models/net/{call}",
                data=b"{}",
                headers={header: value},
            )
            with pytest.raises(urllib.error.HTTPError) as error:
                urllib.request.urlopen(refused, timeout=10)
            assert error.value.code == 404
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc}")
        with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
            client.unload_model("net", headers={f"triton-grpc-protocol-{header}": value})
        assert client.is_model_ready("net")
        # Shared memory is off unless asked for (--shared-memory), over HTTP and gRPC.
        over_http = triton.InferenceServerClient(server.url)
        calls = (
            ("get_system_shared_memory_status", ()),
            ("register_system_shared_memory", ("r", "/r", 16)),
            ("get_cuda_shared_memory_status", ()),
        )
        for each in (client, over_http):
            for method, arguments in calls:
                with pytest.raises(InferenceServerException, match="memory is off") as refused:
                    getattr(each, method)(*arguments)
                assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        over_http.close()
        client.close()


def test_serve_that_did_not_stop_cleanly_says_so_in_one_line_and_exits_1(monkeypatch, capsys):
    import bladesmith.serve as serving
    from bladesmith.serve import ServerStopError

    def stopped_badly(*args, **kwargs):
        raise ServerStopError("serve: tritonserver did not stop cleanly: it crashed")

    monkeypatch.setattr(serving, "serve", stopped_badly)
    assert main(["serve", "net.pt"]) == 1
    err = capsys.readouterr().err
    assert err == "bladesmith serve: error: serve: tritonserver did not stop cleanly: it crashed\n"


def test_serve_refuses_bad_ports_and_names_in_one_line_before_starting(net_artifacts, capsys):
    import socket

    artifact = str(net_artifacts[".pt"])
    http, grpc, metrics = free_ports(3)
    ports = ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]

    def refused(*arguments: str) -> str:
        started = time.monotonic()
        try:
            code = main(["serve", artifact, *arguments])
        except SystemExit as exit:  # argparse's refusals
            code = exit.code
        assert code == 2
        assert time.monotonic() - started < 10  # before Triton starts
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    assert "at most 65535" in refused("--http-port", "70000")
    assert "--http-port" in refused("--http-port", "0")
    err = refused(
        "--http-port", str(http), "--grpc-port", str(http), "--metrics-port", str(metrics)
    )
    assert f"--http-port and --grpc-port are both {http}" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc))
        taken.listen()
        err = refused(*ports)
    assert f"--grpc-port {grpc}: the port is in use on 127.0.0.1" in err
    assert "--name 'bad name/x'" in refused(*ports, "--name", "bad name/x")
    assert "is in use" not in refused(*ports, "--name", "a/b")


def test_bad_urls_and_output_paths_are_one_line_before_any_request(tmp_path, capsys):
    from bladesmith.errors import BladesmithError

    for url in (
        "localhost:abc", "nonsense:::", "localhost", "localhost:70000", "https://h:1",
        "http://[::1", "[::1", "[:1]:8", "[::1]x:80", "a b:80", "h:\u00b2",
    ):  # fmt: skip
        assert main(["loadtest", url]) == 2
        err = capsys.readouterr().err
        assert f"URL {url!r}: expected host:port" in err and len(err.splitlines()) == 1, err
        with pytest.raises(BladesmithError, match="expected host:port"):
            bladesmith.client(url, "x")
    assert "Exception ignored" not in capsys.readouterr().err  # no half-made tritonclient
    [port] = free_ports(1)
    with pytest.raises(SystemExit) as refused:  # checked before the test runs, not after
        main(["loadtest", f"localhost:{port}", "--json", str(tmp_path)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--json" in err and "is a folder" in err and len(err.splitlines()) == 1
