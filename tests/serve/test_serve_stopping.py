"""How a stopping server and its model instances agree (``bladesmith.serve.stopping``):
the stop waits for the batches being computed and for no other, and refuses every later
one. The server itself is stopped under load in test_serve_server.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from bladesmith.serve import stopping


def test_a_stop_waits_for_the_batch_being_computed_then_refuses_every_batch(tmp_path, monkeypatch):
    monkeypatch.setenv(stopping.ENVIRONMENT, stopping.environment(tmp_path)[stopping.ENVIRONMENT])
    admitted = stopping.admission()
    other_instance = stopping.Gate(str(tmp_path)).admitted  # its own open file and lock
    with ThreadPoolExecutor(1) as pool:
        with admitted() as computing:
            assert computing
            stop = pool.submit(stopping.refuse_and_drain, tmp_path, 30)
            time.sleep(0.3)
            assert not stop.done()  # held up by the batch under way
            with other_instance() as another:  # given to another instance meanwhile
                assert not another
            time.sleep(0.3)
            assert not stop.done()  # still held up: the other's refusal released nothing
        assert stop.result(timeout=5)
    with admitted() as later:
        assert not later


def test_a_stop_says_when_a_batch_outlasts_its_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(stopping.ENVIRONMENT, stopping.environment(tmp_path)[stopping.ENVIRONMENT])
    with stopping.admission()() as computing:
        assert computing
        assert not stopping.refuse_and_drain(tmp_path, 0.2)


def test_under_another_server_every_batch_is_admitted(monkeypatch):
    monkeypatch.delenv(stopping.ENVIRONMENT, raising=False)
    with stopping.admission()() as admitted:
        assert admitted
