"""Load test a served model: throughput and latency percentiles per concurrency, with
every answer checked.

Each request carries one distinct random row in the served dtypes (a detector's: a view
of a photograph; an integer input's values within those of the artifact's test data,
which the server gives: random token ids could index nothing). The
answer to every row is first asked alone, one request at a time; under load, each answer
must equal that one, so an answer lost, failed or given to the wrong request is counted,
not hidden in the timings.
"Equal" allows for where the server put the row: a GPU's convolutions give a row's
numbers slightly differently in each slot of a batch (H200, RetinaNet in float32:
scores moved by up to 8.5e-5 between slot 0 and slot 8, and 0 when the row kept its
slot; ``benchmarks/probe_serve_batches.py``), and with the size of the bucket it ran
in. Floats are compared within the rounding of the dtype the model computes in (the
server's ``compute_dtype``, else the output's). A detector's answers are compared as
``optimize``'s gate compares detections: near ties that such a change flips are
excused. So is a detection that the row's own answers from other slots (asked beside
the references, in batches of each bucket size) gain or lose, as the gate excuses what
rounding noise flips; a mix-up is not. A wrong answer closer to another
row's reference than to its own is counted as mixed up: noise does not do that.

The answers are checked after the clock stops, and the requests can come from several
processes (``processes``): one Python process's threads share one interpreter lock, and
a fast server answers faster than they can send and read, so a single process would
time the load generator. Until then each answer, reference and variant is kept as
``answers.compact`` makes it, once its request's time is taken: a detector's without its
padding and with its masks packed to about a bit a pixel, judged the same. A Mask R-CNN's
padded answer at 480x640, 123 MB with 100 detections, is kept in 3.9 MB; on a shared
2-core CPU machine packing it took 30-60 ms, receiving it over loopback HTTP 420-840 ms.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from queue import Empty

import numpy as np

from bladesmith.errors import BladesmithError, one_line
from bladesmith.serve.answers import compact, comparison, distance
from bladesmith.serve.client import Client
from bladesmith.serve.signature import NUMPY_DTYPES, random_rows, smaller_buckets

DISTINCT_ROWS = 64  # rows cycled through; enough that a swapped answer shows
WORKER_TIMEOUT_S = 600.0  # a load-generating process that has not reported by then failed


@dataclass(frozen=True)
class LoadRow:
    concurrency: int
    requests: int
    answered: int  # answers that equal the reference
    wrong: int  # answers that differ from the reference: mixed up or corrupted
    mixed_up: int  # of the wrong, those closer to another row's reference than to their own
    # Of the wrong, the largest distance from their own row's reference (a detector's:
    # 1 - F1 of the detections, 0 where only a field such as a mask is wrong; else the
    # largest absolute difference); 0 when none. Rounding noise stays near 0; a
    # detector's answer to another image is near 1.
    farthest: float
    failed: int  # errors and timeouts
    seconds: float
    throughput: float  # answered requests per second
    p50_ms: float
    p90_ms: float
    p99_ms: float
    # What the server says it did meanwhile (warm-up requests included): rows per model
    # execution, each request's wait in its queue, each execution's compute time.
    batch: float
    queue_ms: float
    compute_ms: float


def loadtest(
    url: str,
    model: str | None = None,
    *,
    concurrency: tuple[int, ...] = (1, 8, 32),
    requests: int = 200,
    seed: int = 0,
    shared_memory: bool = False,
    processes: int = 1,
) -> list[LoadRow]:
    """Send ``requests`` one-row requests at each concurrency to ``model`` at ``url``,
    from at most ``processes`` processes (the concurrency's threads shared among them).
    With ``shared_memory`` the rows are written once into system shared memory, and
    requests carry only their names: what the server sustains, without the client's
    cost of sending each row (the server must run on this machine)."""
    if processes < 1:
        raise BladesmithError(f"loadtest: processes must be at least 1, got {processes}")
    model = model or _only_model(url)
    with Client(url, model) as probe:
        count = min(requests, DISTINCT_ROWS)
        rows = _distinct_rows(probe, count, seed)
        references = [compact(probe.infer(*row), probe.compute_dtype) for row in rows]
        variants = _slot_variants(probe, rows)
        with probe.shared_inputs(rows) if shared_memory else nullcontext() as regions:
            job = _Job(url, model, count, seed, regions, references, variants, probe.compute_dtype)
            return [_run(job, rows, level, requests, processes, probe) for level in concurrency]


@dataclass(frozen=True)
class _Job:
    """What a load-generating process needs (it makes the same rows from the seed)."""

    url: str
    model: str
    rows: int
    seed: int
    regions: list[list[str]] | None
    references: list  # each row's answer alone (``compact``'s)
    variants: list[list]  # each row's answers from other slots of a batch (``compact``'s)
    compute_dtype: str | None


def _run(job, rows, concurrency, requests, processes, probe: Client) -> LoadRow:
    before = probe.statistics()
    workers = min(processes, concurrency)
    shares = [list(range(requests))[k::workers] for k in range(workers)]
    threads = [len(range(concurrency)[k::workers]) for k in range(workers)]
    if workers == 1:
        results = _judged(job, _send(job, rows, shares[0], threads[0], None))
    else:
        results = _in_processes(job, shares, threads)
    outcomes = [outcome for outcome, *_ in results]
    answered = outcomes.count("answered")
    seconds = max(end for _, _, end, _ in results) - min(start for _, start, *_ in results)
    latencies = np.array([end - start for _, start, end, _ in results]) * 1e3
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    served = probe.statistics() - before
    executions, served_requests = max(served.executions, 1), max(served.requests, 1)
    return LoadRow(
        concurrency=concurrency,
        requests=requests,
        answered=answered,
        wrong=outcomes.count("wrong") + outcomes.count("mixed up"),
        mixed_up=outcomes.count("mixed up"),
        farthest=round(max((far for *_, far in results if far is not None), default=0.0), 4),
        failed=outcomes.count("failed"),
        seconds=round(seconds, 3),
        throughput=round(answered / seconds, 2),
        p50_ms=round(float(p50), 2),
        p90_ms=round(float(p90), 2),
        p99_ms=round(float(p99), 2),
        batch=round(served.requests / executions, 2),
        queue_ms=round(served.queue_ns / served_requests / 1e6, 2),
        compute_ms=round(served.compute_ns / executions / 1e6, 2),
    )


def _in_processes(job: _Job, shares: list[list[int]], threads: list[int]) -> list[tuple]:
    """``_send`` in one process per share, started together (a barrier after each has
    connected and warmed up), each judging its answers once all have sent theirs; their
    results, in any order."""
    context = multiprocessing.get_context("spawn")  # no fork of a threaded client
    barrier = context.Barrier(len(shares))
    queue = context.Queue()
    workers = [
        context.Process(target=_worker, args=(job, share, count, barrier, queue), daemon=True)
        for share, count in zip(shares, threads)
    ]
    for worker in workers:
        worker.start()
    results = []
    try:
        for _ in workers:
            try:
                outcome = queue.get(timeout=WORKER_TIMEOUT_S)
            except Empty:
                raise BladesmithError("loadtest: a load-generating process hung or died") from None
            if isinstance(outcome, str):
                raise BladesmithError(f"loadtest: a load-generating process failed: {outcome}")
            results.extend(outcome)
    finally:
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
    return results


def _worker(job: _Job, share, threads, barrier, queue) -> None:
    try:
        with Client(job.url, job.model) as probe:
            rows = _distinct_rows(probe, job.rows, job.seed)
        results = _send(job, rows, share, threads, barrier)
        barrier.wait()  # judged once every process has sent: off the clock
        queue.put(_judged(job, results))
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        queue.put(f"{type(error).__name__}: {error}")


def _send(job: _Job, rows, share: list[int], threads: int, barrier) -> list[tuple]:
    """Send the requests numbered ``share`` (request k carries row k mod rows) from
    ``threads`` threads, each with its own client, after one warm-up request per thread
    (and ``barrier``, where processes start together). Per request: its row, its answer
    (``compact``'s, made once its time is taken; None: failed) and when it started and
    ended (``time.monotonic``, one clock for all processes)."""
    local = threading.local()
    clients: list[Client] = []
    lock = threading.Lock()

    def send(index: int) -> tuple:
        if not hasattr(local, "client"):
            local.client = Client(job.url, job.model)
            with lock:
                clients.append(local.client)
        row = index % len(rows)
        regions = job.regions and job.regions[row]
        start = time.monotonic()
        try:
            answer = local.client.infer(*rows[row], regions=regions)
        except Exception:  # noqa: BLE001 - an error response, a timeout: counted as failed
            return row, None, start, time.monotonic()
        end = time.monotonic()
        return row, compact(answer, job.compute_dtype), start, end

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(send, share[:threads]))  # connect and warm up
            if barrier is not None:
                barrier.wait()
            return list(pool.map(send, share))
    finally:
        for client in clients:
            client.close()


def _judged(job: _Job, results: list[tuple]) -> list[tuple]:
    """Per request: "answered" (equal to its row's reference), "wrong", "mixed up" (wrong,
    and closer to another row's reference than to its own) or "failed", when it started
    and ended, and a wrong answer's distance from its row's reference (else None)."""
    same = comparison(job.compute_dtype)
    judged = []
    for row, answer, start, end in results:
        far = None
        if answer is None:
            outcome = "failed"
        elif same(answer, job.references[row], job.variants[row]):
            outcome = "answered"
        else:
            far = distance(answer, job.references[row])
            mixed = any(
                distance(answer, other) < far for k, other in enumerate(job.references) if k != row
            )
            outcome = "mixed up" if mixed else "wrong"
        judged.append((outcome, start, end, far))
    return judged


def _slot_variants(client: Client, rows: list[list[np.ndarray]]) -> list[list]:
    """A detector's answers to each row from other slots: the rows sent in full batches
    in order and reversed (row i in slot i mod batch, then batch - 1 - that), and in
    order in batches of each power of two below the batch from 2 up (the runner's
    smaller buckets; each costs a request per that many rows). Empty lists for other
    models, and where the server takes one row at a time. Each as ``compact`` keeps it."""
    if not client.detections or client.max_batch < 2:
        return [[] for _ in rows]
    variants: list[list] = [[] for _ in rows]
    order = list(range(len(rows)))
    arrangements = [(order, client.max_batch), (order[::-1], client.max_batch)]
    arrangements += [(order, size) for size in smaller_buckets(client.max_batch)[1:]]
    for arrangement, size in arrangements:
        for start in range(0, len(arrangement), size):
            chunk = arrangement[start : start + size]
            stacked = [np.concatenate(arrays) for arrays in zip(*(rows[i] for i in chunk))]
            answer = client.infer(*stacked)
            for slot, i in enumerate(chunk):
                variant = {name: value[slot : slot + 1] for name, value in answer.items()}
                variants[i].append(compact(variant, client.compute_dtype))
    return variants


def _distinct_rows(client: Client, count: int, seed: int) -> list[list[np.ndarray]]:
    """``count`` requests of one random row each (``random_rows``, all drawn at once): a
    detector's, distinct views of photographs; an integer input's, values in its range
    from the server. Where the server takes whole batches only, each request is one such
    batch."""
    for name, datatype, _ in client.inputs:
        dtype = NUMPY_DTYPES.get(datatype)
        if dtype is None:
            raise BladesmithError(f"loadtest: input type {datatype} is not supported")
        if not client.detections and np.issubdtype(dtype, np.integer):
            if name not in client.input_ranges:
                raise BladesmithError(
                    f"loadtest: {client.model}'s input {name!r} is {datatype}, and the "
                    "server does not say which values it takes (bladesmith serve's models "
                    "do): load test it served by bladesmith serve"
                )
    generator = np.random.default_rng(seed)

    def draw(rows: int | None) -> list[np.ndarray]:
        return [
            random_rows(
                generator,
                NUMPY_DTYPES[datatype],
                [rows, *shape[1:]] if rows else shape,
                client.detections,
                client.input_ranges.get(name),
            )
            for name, datatype, shape in client.inputs
        ]

    if not client.max_batch:
        return [draw(None) for _ in range(count)]
    columns = draw(count)
    return [[column[i : i + 1] for column in columns] for i in range(count)]


def _only_model(url: str) -> str:
    """The one model the server has loaded (from its statistics, which list the loaded
    models over HTTP and gRPC alike)."""
    from bladesmith.serve.client import parse_url

    grpc, address = parse_url(url)
    if grpc:
        from tritonclient.grpc import InferenceServerClient
    else:
        from tritonclient.http import InferenceServerClient
    client = InferenceServerClient(address)
    try:
        if grpc:
            statistics = client.get_inference_statistics(as_json=True)
        else:
            statistics = client.get_inference_statistics()
        models = sorted({m["name"] for m in statistics.get("model_stats", [])})
    except Exception as error:  # noqa: BLE001 - unreachable server: say where
        why = one_line(str(error)) or type(error).__name__
        raise BladesmithError(f"loadtest: cannot reach {url}: {why}") from None
    finally:
        client.close()
    if len(models) != 1:
        raise BladesmithError(f"loadtest: {url} serves {models or 'no model'}; choose --model")
    return models[0]


def render(rows: list[LoadRow]) -> str:
    header = (
        f"{'concurrency':>11} {'requests':>8} {'answered':>8} {'wrong':>5} {'mixed up':>8} "
        f"{'farthest':>8} {'failed':>6} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        "| server: "
        f"{'batch':>6} {'queue ms':>8} {'compute ms':>10}"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row.concurrency:>11} {row.requests:>8} {row.answered:>8} {row.wrong:>5} "
            f"{row.mixed_up:>8} {row.farthest:>8.4g} {row.failed:>6} {row.throughput:>9.1f} "
            f"{row.p50_ms:>8.2f} {row.p90_ms:>8.2f} {row.p99_ms:>8.2f} |         {row.batch:>6.2f} "
            f"{row.queue_ms:>8.2f} {row.compute_ms:>10.2f}"
        )
    return "\n".join(lines)
