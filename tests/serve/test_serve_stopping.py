"""How a stopping server and its model instances agree (``bladesmith.serve.stopping``):
the requests that had arrived when the stop began are computed, those queued included,
later ones refused, and the stop waits for the computations and for no other. The
instances are simulated here, each a gate of its own (its own open files and locks, as
in its own process); the server itself is stopped under load in test_serve_server.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bladesmith.serve import stopping

PAGE = """# HELP nv_inference_pending_request_count Instantaneous number of pending requests.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="net",version="1"} 7
nv_inference_pending_request_count{model="other",version="2"} 0
nv_inference_request_success{model="net",version="1"} 40
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(stopping.ENVIRONMENT, stopping.environment(tmp_path)[stopping.ENVIRONMENT])
    return tmp_path


def _gates(count: int, max_batch: int):
    return [stopping.admission("net", "1", max_batch) for _ in range(count)]


def _take(gate, requests: int) -> bool:
    """Whether the gate admits a batch of ``requests`` (computed at once)."""
    with gate(requests) as admitted:
        return admitted


def test_the_requests_queued_at_the_stop_are_admitted_and_later_ones_refused(folder):
    first, second, third = _gates(3, max_batch=2)
    with ThreadPoolExecutor(1) as pool:
        with first(2) as computing:  # requests 1-2, computed while the stop begins
            assert computing
            assert _take(second, 2)  # 3-4
            # 5 requests queued; the margin: two batches of 2 for each of 3 instances.
            stop = pool.submit(stopping.refuse_and_drain, folder, 30, lambda: {"net/1": 5})
            time.sleep(0.3)
            assert not stop.done()  # the queued requests are still to be taken
            # Numbered 5 to 22 by whichever instance takes them: admitted while the
            # batch's first is at most the cutoff, 4 + 5 + 12 = 21.
            taken = [_take(gate, 2) for gate in (third, second, third) * 3]
            assert taken == [True] * 9
            assert not _take(second, 2)  # 23-24: arrived after the stop
            assert not _take(third, 1)
            time.sleep(0.3)
            assert not stop.done()  # every request that had arrived is taken; one computes
        assert stop.result(timeout=5) is None
    assert not any(_take(gate, 1) for gate in (first, second, third))


def test_a_queue_read_empty_ends_the_stop_once_the_batches_in_transit_are_in(folder):
    gate, other = _gates(2, max_batch=4)
    queued = iter([{"net/1": 1}, {"net/1": 0}])  # at the stop, then in the drain
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        stop = pool.submit(stopping.refuse_and_drain, folder, 30, lambda: next(queued))
        time.sleep(0.1)
        with gate(1) as admitted:  # the queued request, on its way while the queue read empty
            assert admitted
            time.sleep(0.2)
        assert stop.result(timeout=5) is None
        assert time.monotonic() - started >= stopping._TRANSIT_S
    assert not _take(other, 1)  # nothing more once the stop has ended


def test_a_queue_the_metrics_do_not_count_is_refused_as_before_and_the_stop_says_so(folder):
    [gate] = _gates(1, max_batch=2)

    def unreadable():
        raise OSError("connection refused")

    with ThreadPoolExecutor(1) as pool:
        with gate(2) as computing:
            assert computing
            stop = pool.submit(stopping.refuse_and_drain, folder, 30, unreadable)
            time.sleep(0.3)
            assert not stop.done()  # the batch under way is still waited for
            assert not _take(gate, 1)  # queued or not: refused
        problem = stop.result(timeout=5)
    assert "queued at the stop were refused" in problem and "connection refused" in problem
    # A model the metrics do not name is refused alike.
    assert "no pending count for net/1" in stopping.refuse_and_drain(folder, 1, lambda: {})


def test_a_stop_says_when_a_batch_outlasts_its_timeout(folder):
    [gate] = _gates(1, max_batch=1)
    with gate(1) as computing:
        assert computing
        problem = stopping.refuse_and_drain(folder, 0.2, lambda: {"net/1": 0})
    assert problem == "requests that had arrived were unanswered after 0 s"
    assert not _take(gate, 1)  # nothing more is admitted


def test_a_stop_cut_short_returns_at_once_and_admits_nothing_more(folder):
    [gate] = _gates(1, max_batch=1)
    cut_short = threading.Event()
    with ThreadPoolExecutor(1) as pool, gate(1) as computing:
        assert computing
        stop = pool.submit(stopping.refuse_and_drain, folder, 30, lambda: {"net/1": 3}, cut_short)
        time.sleep(0.2)
        assert not stop.done()
        cut_short.set()
        assert stop.result(timeout=1) is None  # the caller says it was cut short
        assert not _take(gate, 1)  # queued or not: the server is about to end


def test_the_pending_requests_are_read_per_model_version_from_the_metrics():
    assert stopping.pending_requests(PAGE) == {"net/1": 7, "other/2": 0}


def test_under_another_server_every_batch_is_admitted(monkeypatch):
    monkeypatch.delenv(stopping.ENVIRONMENT, raising=False)
    with stopping.admission("net", "1", 8)(8) as admitted:
        assert admitted
