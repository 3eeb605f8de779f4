"""Load test a served model: throughput and latency percentiles per concurrency, with
every answer checked.

Each request carries one distinct random row. The answer to every row is first asked
alone, one request at a time; under load, each answer must equal that one, so an answer
lost, failed or given to the wrong request is counted, not hidden in the timings.
"Equal" allows for where the server put the row: a GPU's convolutions give a row's
numbers slightly differently in each slot of a batch (H200, RetinaNet in float32:
scores moved by up to 8.5e-5 between slot 0 and slot 8, and 0 when the row kept its
slot; ``benchmarks/probe_serve_batches.py``). Floats are compared within their dtype's
rounding, and a detector's answers as ``optimize``'s gate compares detections: near ties
that such a change flips are excused, a mix-up is not.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from bladesmith.errors import BladesmithError
from bladesmith.families.base import DetectionFamily
from bladesmith.serve.client import Client, cut_padding
from bladesmith.verify import compare_detections

DISTINCT_ROWS = 64  # rows cycled through; enough that a swapped answer shows


@dataclass(frozen=True)
class LoadRow:
    concurrency: int
    requests: int
    answered: int  # answers that equal the reference
    wrong: int  # answers that differ from the reference: mixed up or corrupted
    failed: int  # errors and timeouts
    seconds: float
    throughput: float  # answered requests per second
    p50_ms: float
    p90_ms: float
    p99_ms: float


def loadtest(
    url: str,
    model: str | None = None,
    *,
    concurrency: tuple[int, ...] = (1, 8, 32),
    requests: int = 200,
    seed: int = 0,
    shared_memory: bool = False,
) -> list[LoadRow]:
    """Send ``requests`` one-row requests at each concurrency to ``model`` at ``url``.
    With ``shared_memory`` the rows are written once into system shared memory, and
    requests carry only their names: what the server sustains, without the client's
    cost of sending each row (the server must run on this machine)."""
    model = model or _only_model(url)
    with Client(url, model) as probe:
        rows = _distinct_rows(probe, min(requests, DISTINCT_ROWS), seed)
        references = [probe.infer(*row) for row in rows]
        with probe.shared_inputs(rows) if shared_memory else nullcontext() as regions:
            return [
                _run(url, model, rows, references, level, requests, regions)
                for level in concurrency
            ]


def _run(url, model, rows, references, concurrency: int, requests: int, regions) -> LoadRow:
    local = threading.local()
    clients: list[Client] = []
    lock = threading.Lock()

    def send(index: int) -> tuple[str, float]:
        if not hasattr(local, "client"):
            local.client = Client(url, model)
            with lock:
                clients.append(local.client)
        row = index % len(rows)
        start = time.perf_counter()
        try:
            answer = local.client.infer(*rows[row], regions=regions and regions[row])
        except Exception:  # noqa: BLE001 - an error response, a timeout: counted as failed
            return "failed", time.perf_counter() - start
        elapsed = time.perf_counter() - start
        return ("answered" if _same(answer, references[row]) else "wrong"), elapsed

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(send, range(min(concurrency, requests))))  # connect and warm up
            start = time.perf_counter()
            results = list(pool.map(send, range(requests)))
            seconds = time.perf_counter() - start
    finally:
        for client in clients:
            client.close()
    outcomes = [outcome for outcome, _ in results]
    latencies = np.array([elapsed for _, elapsed in results]) * 1e3
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    answered = outcomes.count("answered")
    return LoadRow(
        concurrency=concurrency,
        requests=requests,
        answered=answered,
        wrong=outcomes.count("wrong"),
        failed=outcomes.count("failed"),
        seconds=round(seconds, 3),
        throughput=round(answered / seconds, 2),
        p50_ms=round(float(p50), 2),
        p90_ms=round(float(p90), 2),
        p99_ms=round(float(p99), 2),
    )


def _distinct_rows(client: Client, count: int, seed: int) -> list[list[np.ndarray]]:
    """``count`` requests of one random row each, like images: float32 in [0, 1), or
    uint8."""
    generator = np.random.default_rng(seed)
    requests = []
    for _ in range(count):
        arrays = []
        for _, datatype, shape in client.inputs:
            row = [1, *shape[1:]] if client.max_batch else shape
            if datatype == "FP32":
                arrays.append(generator.random(row, dtype=np.float32))
            elif datatype == "UINT8":
                arrays.append(generator.integers(0, 256, row, dtype=np.uint8))
            else:
                raise BladesmithError(f"loadtest: input type {datatype} is not supported")
        requests.append(arrays)
    return requests


def _same(answer: dict, reference: dict) -> bool:
    if answer.keys() != reference.keys():
        return False
    if any(answer[name].shape != expected.shape for name, expected in reference.items()):
        return False
    if tuple(reference)[:4] == DetectionFamily.output_names:
        return compare_detections(_detections(reference), _detections(answer)).passed
    return all(_close(answer[name], expected) for name, expected in reference.items())


def _close(got: np.ndarray, expected: np.ndarray) -> bool:
    if not np.issubdtype(expected.dtype, np.floating):
        return np.array_equal(got, expected)
    tolerance = 1e-2 if expected.dtype.itemsize < 4 else 1e-4  # half precision: 2^-11
    return np.allclose(got, expected, rtol=tolerance, atol=tolerance)


def _detections(answer: dict) -> list[dict]:
    """A served answer's padded detections, one dict of tensors per row, cut as
    ``bladesmith.client`` cuts them (``cut_padding``)."""
    import torch

    rows = len(answer["num_detections"])
    per_row = [
        cut_padding({name: value[row] for name, value in answer.items()}) for row in range(rows)
    ]
    # np.array: a writable copy (tritonclient's arrays are read-only).
    return [
        {name: torch.from_numpy(np.array(value)) for name, value in row.items()} for row in per_row
    ]


def _only_model(url: str) -> str:
    from tritonclient.http import InferenceServerClient

    if url.startswith("grpc://"):
        raise BladesmithError("loadtest: name the model (--model) when the URL is gRPC")
    client = InferenceServerClient(url.removeprefix("http://"))
    try:
        models = [m["name"] for m in client.get_model_repository_index() if m.get("state")]
    except Exception as error:  # noqa: BLE001 - unreachable server: say where
        raise BladesmithError(f"loadtest: cannot reach {url}: {error}") from None
    finally:
        client.close()
    if len(models) != 1:
        raise BladesmithError(f"loadtest: {url} serves {models or 'no model'}; choose --model")
    return models[0]


def render(rows: list[LoadRow]) -> str:
    header = (
        f"{'concurrency':>11} {'requests':>8} {'answered':>8} {'wrong':>5} {'failed':>6} "
        f"{'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row.concurrency:>11} {row.requests:>8} {row.answered:>8} {row.wrong:>5} "
            f"{row.failed:>6} {row.throughput:>9.1f} {row.p50_ms:>8.2f} {row.p90_ms:>8.2f} "
            f"{row.p99_ms:>8.2f}"
        )
    return "\n".join(lines)
