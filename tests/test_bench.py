import dataclasses
import time

import numpy as np
import pytest
import torch

from bladesmith import bench
from bladesmith.bench import Timing, measure, measure_batches, percentile


def test_percentile_matches_numpy():
    values = np.random.default_rng(0).exponential(size=257)
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\]"):
        percentile([1.0], 101)


def test_timing_from_known_samples():
    samples = np.arange(1, 101, dtype=float)
    timing = Timing.from_samples(
        samples, warmup=3, method="perf_counter", device="cpu", batch_size=4
    )
    assert timing.mean_ms == pytest.approx(50.5)
    assert timing.p50_ms == pytest.approx(50.5)
    assert timing.p90_ms == pytest.approx(90.1)
    assert timing.p99_ms == pytest.approx(99.01)
    assert (timing.min_ms, timing.max_ms) == (1.0, 100.0)
    assert timing.std_ms == pytest.approx(samples.std(ddof=1))
    assert timing.throughput == pytest.approx(4 / 0.0505)
    assert (timing.iterations, timing.warmup) == (100, 3)
    assert Timing.from_dict(timing.to_dict()) == timing


def test_measure_cpu_sleep():
    calls = []

    def sleepy(x):
        calls.append(x)
        time.sleep(0.002)

    timing = measure(sleepy, (torch.ones(1),), warmup=2, iters=6, batch_size=8)
    assert len(calls) == 8
    assert timing.method == "perf_counter" and timing.device == "cpu"
    assert (timing.warmup, timing.iterations, timing.batch_size) == (2, 6, 8)
    assert timing.min_ms >= 2.0 and timing.mean_ms >= 2.0
    assert timing.min_ms <= timing.p50_ms <= timing.p90_ms <= timing.p99_ms <= timing.max_ms
    assert timing.throughput == pytest.approx(8 / (timing.p50_ms / 1000))


def test_measure_passes_kwargs_and_reports_progress():
    seen = []
    events = []
    measure(
        lambda a, b=0: seen.append((a, b)),
        (1,),
        {"b": 2},
        warmup=2,
        iters=3,
        progress=lambda stage, done, total: events.append((stage, done, total)),
    )
    assert seen == [(1, 2)] * 5
    assert events == [
        ("warmup", 1, 2),
        ("warmup", 2, 2),
        ("timing", 1, 3),
        ("timing", 2, 3),
        ("timing", 3, 3),
    ]


def test_measure_rejects_bad_arguments():
    for kwargs, name in (
        ({"iters": 0}, "iters"),
        ({"warmup": -1}, "warmup"),
        ({"batch_size": 0}, "batch_size"),
    ):
        with pytest.raises(ValueError, match=name):
            measure(lambda: None, **kwargs)


def test_measure_refuses_a_device_it_cannot_synchronise():
    with pytest.raises(ValueError, match="device meta: bladesmith cannot synchronise"):
        measure(lambda x: x, (torch.empty(2, device="meta"),), warmup=0, iters=1)


def test_measure_batches_reports_throughput_per_batch_size():
    def make(batch_size):
        return (lambda x: time.sleep(0.001 * x.shape[0])), (torch.zeros(batch_size, 3),)

    timings = measure_batches(make, [1, 4], warmup=1, iters=3)
    assert [t.batch_size for t in timings] == [1, 4]
    assert timings[1].mean_ms >= 4.0
    for timing in timings:
        assert timing.throughput == pytest.approx(timing.batch_size * 1000 / timing.p50_ms)


class FakeClock:
    """A device timeline: each call of the timed function takes 3 ms of 'GPU' time."""

    def __init__(self):
        self.now = 0.0
        self.synchronized = 0
        self.read_after_sync = []

    def event_class(self):
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.time = None

            def record(self, stream):
                assert stream == "stream"
                self.time = clock.now

            def elapsed_time(self, end):
                clock.read_after_sync.append(clock.synchronized)
                return end.time - self.time

        return Event


def test_cuda_path_uses_events_and_synchronises_once(monkeypatch):
    clock = FakeClock()

    class NoDevice:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def synchronize(device=None):
        clock.synchronized += 1

    monkeypatch.setattr(torch.cuda, "Event", clock.event_class())
    monkeypatch.setattr(torch.cuda, "device", NoDevice)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)

    def step():
        clock.now += 3.0

    timing = measure(step, warmup=4, iters=10, device="cuda:0", batch_size=2)
    assert timing.method == bench.METHOD_CUDA_EVENTS
    assert timing.device == "cuda:0"
    assert timing.mean_ms == pytest.approx(3.0) and timing.p99_ms == pytest.approx(3.0)
    assert timing.iterations == 10
    # Once after the warm-up, once after the timed runs; none per iteration.
    assert clock.synchronized == 2
    assert clock.read_after_sync == [2] * 10
    assert timing.throughput == pytest.approx(2 / 0.003)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_on_a_real_gpu():
    a = torch.randn(1024, 1024, device="cuda")
    timing = measure(torch.matmul, (a, a), warmup=5, iters=20)
    assert timing.method == "cuda-events"
    assert timing.device.startswith("cuda")
    assert 0 < timing.min_ms <= timing.p50_ms <= timing.p99_ms <= timing.max_ms


def test_median_interval_from_order_statistics():
    # Twenty rounds: x(4)..x(17) holds the median with 1 - 2 P(Bin(20, 1/2) <= 3) > 99%
    # (x(5)..x(16) only with 98.8%).
    low, high, confidence = bench.median_interval(list(range(20, 0, -1)))
    assert (low, high) == (4, 17)
    assert confidence == pytest.approx(1 - 2 * 1351 / 2**20)
    # Ten: only the full range reaches 99% (x(2)..x(9) holds it with 97.9%).
    assert bench.median_interval(list(range(10))) == (0, 9, pytest.approx(1 - 2 / 1024))
    # Five rounds cannot reach 95%: the full range, with what it does hold.
    assert bench.median_interval([3, 1, 2, 5, 4]) == (1, 5, pytest.approx(1 - 2 / 32))
    with pytest.raises(ValueError, match="empty"):
        bench.median_interval([])


def test_compare_alternates_which_runs_first():
    order = []
    bench.compare(lambda: order.append("A"), lambda: order.append("B"), warmup=1, iters=6, rounds=3)
    assert order[:2] == ["A", "B"]  # warm-up, one each
    timed = order[2:]
    assert timed == ["A", "A", "B", "B", "B", "B", "A", "A", "A", "A", "B", "B"]


def test_compare_runs_more_rounds_while_undecided_and_continues_the_alternation():
    order, seen = [], []

    def undecided(speedup):
        seen.append(len(speedup.round_ratios))
        return True

    speedup = bench.compare(
        lambda: order.append("A"),
        lambda: order.append("B"),
        warmup=0,
        iters=4,
        rounds=2,
        undecided=undecided,
        max_extensions=2,
    )
    assert seen == [2, 4]  # asked after the first rounds and after the first extension
    assert len(speedup.round_ratios) == 6
    assert speedup.baseline.iterations == speedup.candidate.iterations == 12
    # The extensions go on alternating: round 3 starts with A, as every odd round does.
    assert order == ["A", "A", "B", "B", "B", "B", "A", "A"] * 3
    decided = bench.compare(
        lambda: None,
        lambda: None,
        warmup=0,
        iters=4,
        rounds=2,
        undecided=lambda speedup: False,
        max_extensions=2,
    )
    assert len(decided.round_ratios) == 2


def test_compare_reads_a_real_speedup_with_an_interval():
    speedup = bench.compare(
        lambda: time.sleep(0.008), lambda: time.sleep(0.002), warmup=1, iters=20
    )
    assert len(speedup.round_ratios) == 10
    assert speedup.ratio == speedup.baseline.p50_ms / speedup.candidate.p50_ms
    assert speedup.clears(1.2) and speedup.ratio < 4
    assert speedup.baseline.iterations == speedup.candidate.iterations == 20
    assert speedup.describe().startswith(f"{speedup.ratio:.2f}x [")
    assert bench.Speedup.from_dict(speedup.to_dict()) == speedup


def test_compare_is_not_fooled_by_a_machine_that_slows_down():
    """Both sides run the same code on a machine that gets slower with every call:
    timed one after the other, the second would read as twice as slow; alternating
    rounds keep the median ratio at 1 and the interval around it."""
    calls = [0]

    def drifting():
        calls[0] += 1
        time.sleep(0.001 * (1 + 0.2 * calls[0]))

    speedup = bench.compare(drifting, drifting, warmup=0, iters=10)
    assert speedup.low <= 1.0 <= speedup.high
    assert not speedup.clears(1.0)
    calls[0] = 0
    first = measure(drifting, warmup=0, iters=10)
    second = measure(drifting, warmup=0, iters=10)
    assert first.p50_ms / second.p50_ms < 0.7  # what timing them apart would have said


def test_compare_doubts_what_cannot_be_right(monkeypatch):
    assert 0 < bench.launch_floor_ms("cpu") < 1.0  # one-element additions, measured
    monkeypatch.setattr(bench, "launch_floor_ms", lambda device: 0.5)
    nothing = bench.compare(lambda: time.sleep(0.002), lambda: None, warmup=1, iters=5)
    assert nothing.implausible
    assert any("below cpu's launch floor (0.5000 ms)" in d for d in nothing.doubts), nothing
    one = torch.zeros(1)
    too_fast = bench.compare(lambda: time.sleep(0.1), lambda: one.add(1), warmup=0, iters=3)
    assert too_fast.implausible
    assert any("more than removing work can give on cpu" in d for d in too_fast.doubts)
    assert too_fast.cpu_ratio is not None  # the CPU time's cross-check


def test_compare_doubts_a_spread_out_run():
    calls = [0]

    def jumpy():
        calls[0] += 1
        time.sleep(0.02 if calls[0] % 5 == 0 else 0.002)

    speedup = bench.compare(jumpy, lambda: time.sleep(0.002), warmup=0, iters=10, rounds=2)
    assert not speedup.implausible
    assert any("the baseline's p90" in doubt for doubt in speedup.doubts), speedup


def test_a_ratio_outside_the_rounds_interval_is_doubted():
    """The ratio of the medians pools every round; the interval is the rounds' own
    ratios': where the rounds disagree the two can part, and the figure says so."""
    speedup = bench.compare(
        lambda: time.sleep(0.002), lambda: time.sleep(0.001), warmup=0, iters=4, rounds=2
    )
    within = dataclasses.replace(speedup, ratio=speedup.high * 1.01)
    inside, _ = bench._doubts(within, torch.device("cpu"))
    assert not any("lies outside" in doubt for doubt in inside)
    parted = dataclasses.replace(speedup, ratio=speedup.high * 1.5)
    doubts, implausible = bench._doubts(parted, torch.device("cpu"))
    assert not implausible
    assert any("lies outside the interval of the rounds' own ratios" in d for d in doubts)
