"""Timing: warm-up, timed iterations synchronised with the device, percentiles, and
speedups measured in interleaved rounds with a noise estimate.

On CUDA each iteration is bracketed by a pair of ``torch.cuda.Event`` records on the
current stream and the host synchronises once, after the last one: the events measure
the device's timeline without a host round trip per iteration. Elsewhere each iteration
is timed with ``time.perf_counter``; on accelerators other than CUDA (mps, xpu) the host
synchronises after every iteration, so the clock sees the device's work.

A speedup (``compare``) is never a ratio of two timings taken minutes apart, which on a
busy machine reads a change of load as a speedup. The baseline and the candidate run in
alternating rounds (A/B, then B/A, ...), and each round's ratio is taken within the round.
The figure is the median of those ratios, with an interval from the rounds' spread
(``STATISTIC`` says so in words). ``Speedup.doubts`` lists what makes a figure implausible.

torch is imported inside the functions that need it, so that reading a report (which
uses ``Timing``) does not load it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np

# PAI-Blade's tutorial times 100 warm-up and 200 timed runs.
DEFAULT_WARMUP = 100
DEFAULT_ITERS = 200

METHOD_CUDA_EVENTS = "cuda-events"
METHOD_PERF_COUNTER = "perf_counter"

# The one statistic of every latency and speedup that optimize reports and decides on.
STATISTIC = (
    "median latency (p50) over runs interleaved in alternating rounds; speedup = the "
    "baseline's p50 over the candidate's, with a distribution-free interval from the "
    "rounds' own ratios (their order statistics)"
)
DEFAULT_ROUNDS = 10
INTERVAL_CONFIDENCE = 0.99
# Past these a figure is doubted in the diagnosis rather than printed as fact.
SPREAD_LIMIT = 1.5  # p90 / p50 of either run: the machine was busy
PLAUSIBLE_SPEEDUP = {"cpu": 20.0}  # above it: more than removing the work could give
DEFAULT_PLAUSIBLE_SPEEDUP = 100.0  # accelerators, where CUDA graphs remove launch costs

# progress(stage, done, total): stage is "warmup" or "timing"; called after each run.
TimingCallback = Callable[[str, int, int], None]


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0..100) of ``values``, interpolating linearly between ranks."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("percentile of an empty sequence")
    return float(np.percentile(array, q))


@dataclass(frozen=True)
class Timing:
    """Latency statistics of one function at one batch size; times in milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    std_ms: float
    iterations: int
    warmup: int
    method: str
    device: str
    batch_size: int
    throughput: float  # items per second: batch_size / median latency

    @classmethod
    def from_samples(
        cls,
        samples_ms: Sequence[float],
        *,
        warmup: int,
        method: str,
        device: str,
        batch_size: int = 1,
    ) -> Timing:
        samples = np.asarray(samples_ms, dtype=np.float64)
        if samples.size == 0:
            raise ValueError("samples_ms is empty: time at least one iteration")
        mean = float(samples.mean())
        median = percentile(samples, 50)
        return cls(
            mean_ms=mean,
            p50_ms=median,
            p90_ms=percentile(samples, 90),
            p99_ms=percentile(samples, 99),
            min_ms=float(samples.min()),
            max_ms=float(samples.max()),
            std_ms=float(samples.std(ddof=1)) if samples.size > 1 else 0.0,
            iterations=int(samples.size),
            warmup=warmup,
            method=method,
            device=device,
            batch_size=batch_size,
            throughput=batch_size * 1000.0 / median if median > 0 else math.inf,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Timing:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


def measure(
    fn: Callable,
    args: Sequence = (),
    kwargs: Mapping | None = None,
    warmup: int = DEFAULT_WARMUP,
    iters: int = DEFAULT_ITERS,
    device=None,
    batch_size: int = 1,
    progress: TimingCallback | None = None,
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed runs, then ``iters`` timed ones.

    ``device`` (a ``torch.device`` or string) picks the clock and the synchronisation;
    when None it is the device of the first CUDA tensor found in the arguments, else
    the first tensor's, else the CPU. ``batch_size`` is the number of items one call
    processes, for the throughput. Grad mode is the caller's: wrap the call in
    ``torch.inference_mode()`` to time inference.
    """
    _check_counts(warmup=(warmup, 0), iters=(iters, 1), batch_size=(batch_size, 1))
    kwargs = dict(kwargs or {})
    clock = _Clock(_device(device, (args, kwargs)))

    def call() -> None:
        fn(*args, **kwargs)

    with _collector_held(), clock.selected():
        for done in range(1, warmup + 1):
            call()
            _report(progress, "warmup", done, warmup)
        clock.synchronize()
        samples, _ = clock.time(call, iters, lambda done: _report(progress, "timing", done, iters))
    return clock.timing(samples, warmup, batch_size)


@dataclass(frozen=True)
class Speedup:
    """How much faster a candidate ran than a baseline, timed in interleaved rounds.

    ``ratio`` is the baseline's median latency over the candidate's, both over every
    round, so that "a ms -> b ms" and the speedup printed beside it agree; [``low``,
    ``high``] holds the median of the rounds' own ratios (each round's median latencies)
    with probability ``confidence``: order statistics, no assumption on the noise.
    ``cpu_ratio`` is the same figure from the process's CPU time (host devices), a
    cross-check that the machine's load cannot move; ``load`` the load average per core
    while timing (None where unknown). ``doubts`` says why a figure is not to be taken as
    fact; ``implausible`` is True when one of them says the figure cannot be right.
    """

    ratio: float
    low: float
    high: float
    confidence: float
    round_ratios: tuple[float, ...]
    baseline: Timing
    candidate: Timing
    cpu_ratio: float | None = None
    load: float | None = None
    doubts: tuple[str, ...] = ()
    implausible: bool = False

    def clears(self, threshold: float) -> bool:
        """Faster than ``threshold`` beyond the noise: the whole interval is above it."""
        return self.low > threshold

    def describe(self) -> str:
        """ "1.42x [1.30-1.55]": the median ratio and its interval."""
        return f"{self.ratio:.2f}x [{self.low:.2f}-{self.high:.2f}]"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["round_ratios"] = list(self.round_ratios)
        data["doubts"] = list(self.doubts)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> Speedup:
        values = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        values["baseline"] = Timing.from_dict(data["baseline"])
        values["candidate"] = Timing.from_dict(data["candidate"])
        values["round_ratios"] = tuple(data["round_ratios"])
        values["doubts"] = tuple(data.get("doubts", ()))
        return cls(**values)


def compare(
    baseline: Callable,
    candidate: Callable,
    args: Sequence = (),
    kwargs: Mapping | None = None,
    warmup: int = DEFAULT_WARMUP,
    iters: int = DEFAULT_ITERS,
    rounds: int = DEFAULT_ROUNDS,
    device=None,
    batch_size: int = 1,
    progress: TimingCallback | None = None,
    undecided: Callable[[Speedup], bool] | None = None,
    max_extensions: int = 0,
) -> Speedup:
    """Time ``baseline`` and ``candidate`` on the same arguments in alternating rounds.

    Each runs ``warmup`` untimed calls, then ``iters`` timed calls split over
    ``min(rounds, iters)`` rounds; rounds alternate which goes first (A/B, B/A, ...), so
    that neither always inherits the other's caches or clock. A change of load between
    rounds moves both sides of a round's ratio alike. ``progress`` gets ("warmup", done,
    2 * warmup) and ("timing", round, rounds).

    While ``undecided(speedup)`` holds (its interval straddles the bar a caller decides
    on, say), the same rounds run again, at most ``max_extensions`` times, and the
    figure is taken over all of them: more rounds narrow the interval, so a real gain on
    a noisy machine is not lost to a handful of disturbed rounds.
    """
    _check_counts(
        warmup=(warmup, 0),
        iters=(iters, 1),
        rounds=(rounds, 1),
        batch_size=(batch_size, 1),
        max_extensions=(max_extensions, 0),
    )
    kwargs = dict(kwargs or {})
    clock = _Clock(_device(device, (args, kwargs)))
    calls = [lambda fn=fn: fn(*args, **kwargs) for fn in (baseline, candidate)]
    sizes = round_sizes(iters, rounds)
    rounds = len(sizes)
    wall: list[list[list[float]]] = [[], []]  # [which][round] -> samples
    cpu: list[list[list[float]]] = [[], []]
    load_before = _load_per_core()

    def run_rounds(total: int) -> None:
        for size in sizes:
            for which in (0, 1) if len(wall[0]) % 2 == 0 else (1, 0):
                samples, cpu_samples = clock.time(calls[which], size)
                wall[which].append(samples)
                cpu[which].append(cpu_samples)
            _report(progress, "timing", len(wall[0]), total)

    with _collector_held(), clock.selected():
        for which, call in enumerate(calls):
            for done in range(1, warmup + 1):
                call()
                _report(progress, "warmup", which * warmup + done, 2 * warmup)
        clock.synchronize()
        run_rounds(rounds)
        speedup = _speedup(clock, wall, cpu, warmup, batch_size, load_before)
        for extension in range(1, max_extensions + 1):
            if undecided is None or not undecided(speedup):
                break
            run_rounds(rounds * (extension + 1))
            speedup = _speedup(clock, wall, cpu, warmup, batch_size, load_before)
    return speedup


def time_round(fn: Callable, args: Sequence = (), iters: int = 1, device=None):
    """``fn(*args)`` timed alone, ``iters`` calls: (wall ms, CPU ms) samples, one each.
    For runners that cannot be called in turn from one loop (one of them reloaded in
    another process): ``from_rounds`` sets such rounds against each other."""
    _check_counts(iters=(iters, 1))
    clock = _Clock(_device(device, args))
    with _collector_held(), clock.selected():
        clock.synchronize()
        return clock.time(lambda: fn(*args), iters)


def round_sizes(iters: int, rounds: int) -> list[int]:
    """``iters`` calls shared out over ``min(rounds, iters)`` rounds, as ``compare`` does."""
    _check_counts(iters=(iters, 1), rounds=(rounds, 1))
    rounds = min(rounds, iters)
    return [iters // rounds + (1 if index < iters % rounds else 0) for index in range(rounds)]


def from_rounds(
    baseline: list[tuple[list[float], list[float]]],
    candidate: list[tuple[list[float], list[float]]],
    *,
    warmup: int,
    batch_size: int,
    device,
) -> Speedup:
    """The Speedup of rounds timed in turn by the caller (``time_round``), round i of
    each side next to the other in time: the same statistic as ``compare``."""
    import torch

    clock = _Clock(torch.device(device))
    wall = [[samples for samples, _ in baseline], [samples for samples, _ in candidate]]
    cpu = [[times for _, times in baseline], [times for _, times in candidate]]
    return _speedup(clock, wall, cpu, warmup, batch_size, _load_per_core())


def _speedup(clock, wall, cpu, warmup: int, batch_size: int, load_before) -> Speedup:
    """The Speedup of the rounds timed so far, with its doubts."""
    loads = [value for value in (load_before, _load_per_core()) if value is not None]
    timings = [clock.timing(_flat(runs), warmup, batch_size) for runs in wall]
    ratios = _round_ratios(wall[0], wall[1])
    low, high, confidence = median_interval(ratios)
    cpu_ratio = None
    if clock.device.type == "cpu":
        cpu_ratio = float(np.median(_round_ratios(cpu[0], cpu[1])))
    speedup = Speedup(
        ratio=timings[0].p50_ms / timings[1].p50_ms if timings[1].p50_ms > 0 else math.inf,
        low=low,
        high=high,
        confidence=confidence,
        round_ratios=tuple(ratios),
        baseline=timings[0],
        candidate=timings[1],
        cpu_ratio=cpu_ratio,
        load=sum(loads) / len(loads) if loads else None,
    )
    doubts, implausible = _doubts(speedup, clock.device)
    return dataclasses.replace(speedup, doubts=doubts, implausible=implausible)


def same(timing: Timing) -> Speedup:
    """A run against itself, timed once: 1.00x by construction, with its doubts."""
    speedup = Speedup(
        ratio=1.0,
        low=1.0,
        high=1.0,
        confidence=1.0,
        round_ratios=(),
        baseline=timing,
        candidate=timing,
    )
    doubts, implausible = _doubts(speedup, _device(timing.device, ()))
    return dataclasses.replace(speedup, doubts=doubts, implausible=implausible)


def median_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(low, high, confidence): the narrowest pair of order statistics that holds the
    median of the distribution behind ``values`` with probability >= 99%, or, with too
    few values for that, the full range and its (lower) confidence. 99% rather than
    95%: a pass that changes nothing must not read as faster one run in twenty."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median_interval of an empty sequence")

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n+1-k))
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= INTERVAL_CONFIDENCE:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k) if n > 1 else 0.0


def launch_floor_ms(device) -> float:
    """The fastest anything runs on ``device``: the median of one-element additions,
    timed with the clock a model gets. A model's latency below it missed its work."""
    import torch

    device = torch.device(device)
    key = str(device)
    if key not in _FLOORS:
        clock = _Clock(device)
        one = torch.zeros(1, device=device)
        for _ in range(5):
            one.add_(1)
        clock.synchronize()
        samples, _ = clock.time(lambda: one.add_(1), 50)
        _FLOORS[key] = percentile(samples, 50)
    return _FLOORS[key]


_FLOORS: dict[str, float] = {}


OUTSIDE_MARGIN = 1.02  # how far a ratio may sit outside its rounds' interval undoubted


def _doubts(speedup: Speedup, device) -> tuple[tuple[str, ...], bool]:
    """What makes ``speedup``'s figures doubtful, and whether one makes it impossible."""
    doubts, implausible = [], False
    floor = launch_floor_ms(device)
    for name, timing in (("baseline", speedup.baseline), ("candidate", speedup.candidate)):
        if timing.p50_ms < floor:
            implausible = True
            doubts.append(
                f"the {name}'s median {timing.p50_ms:.4f} ms is below {device.type}'s launch "
                f"floor ({floor:.4f} ms): the clock missed its work"
            )
        spread = timing.p90_ms / timing.p50_ms if timing.p50_ms > 0 else math.inf
        if spread > SPREAD_LIMIT:
            doubts.append(
                f"the {name}'s p90 is {spread:.1f}x its p50 (limit {SPREAD_LIMIT:g}x): the "
                "machine was busy; its latencies are noisy"
            )
    cap = PLAUSIBLE_SPEEDUP.get(device.type, DEFAULT_PLAUSIBLE_SPEEDUP)
    if speedup.ratio > cap:
        implausible = True
        doubts.append(
            f"{speedup.ratio:.1f}x is more than removing work can give on {device.type} "
            f"(above {cap:g}x): a timing artefact"
        )
    # A hair outside is rounding of two medians; a material gap is rounds that disagree.
    if not speedup.low / OUTSIDE_MARGIN <= speedup.ratio <= speedup.high * OUTSIDE_MARGIN:
        doubts.append(
            f"the ratio of the medians over all rounds ({speedup.ratio:.2f}x) lies outside "
            f"the interval of the rounds' own ratios [{speedup.low:.2f}-{speedup.high:.2f}]: "
            "the rounds disagree (more rounds, Config(rounds=...), would settle it)"
        )
    loaded = speedup.load is not None and speedup.load >= 1.0
    cpu = speedup.cpu_ratio
    if loaded and cpu is not None and not speedup.low <= cpu <= speedup.high:
        doubts.append(
            f"under load ({speedup.load:.1f} per core) the process's CPU time gives "
            f"{cpu:.2f}x, outside the wall clock's interval {speedup.describe()}"
        )
    return tuple(doubts), implausible


def _round_ratios(baseline: list[list[float]], candidate: list[list[float]]) -> list[float]:
    ratios = []
    for before, after in zip(baseline, candidate, strict=True):
        b, a = float(np.median(before)), float(np.median(after))
        ratios.append(b / a if a > 0 else math.inf)
    return ratios


def _flat(runs: list[list[float]]) -> list[float]:
    return [sample for run in runs for sample in run]


def _load_per_core() -> float | None:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):  # Windows has no load average
        return None


def _check_counts(**counts: tuple[int, int]) -> None:
    for name, (value, least) in counts.items():
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _device(device, tree):
    import torch

    return torch.device(device) if device is not None else _infer_device(tree)


class _collector_held:
    """The garbage collector's pauses would land in random iterations: collect once,
    then hold it for the timed runs."""

    def __enter__(self):
        self.was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def __exit__(self, *exc_info):
        if self.was_enabled:
            gc.enable()


class _Clock:
    """The clock of one device. CUDA: a pair of events per iteration on the current
    stream, one host synchronisation per batch of iterations. Elsewhere: perf_counter per
    iteration (and the process's CPU time), synchronising after each on accelerators."""

    def __init__(self, device):
        self.device = device
        self.method = METHOD_CUDA_EVENTS if device.type == "cuda" else METHOD_PERF_COUNTER
        self._sync = None if device.type == "cuda" else _host_synchronizer(device)

    def selected(self):
        """The device made current while timing (CUDA), so "cuda" means it."""
        import torch

        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self._sync is not None:
            self._sync()

    def time(self, call, iters: int, done=None) -> tuple[list[float], list[float]]:
        """(wall ms, CPU ms) of ``iters`` calls; CPU times are empty on CUDA."""
        if self.device.type == "cuda":
            return _time_cuda(call, iters, self.device, done), []
        wall, cpu = [], []
        for count in range(1, iters + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            if self._sync is not None:
                self._sync()
            wall.append((time.perf_counter() - start) * 1000.0)
            cpu.append((time.process_time() - start_cpu) * 1000.0)
            if done is not None:
                done(count)
        return wall, cpu

    def timing(self, samples, warmup: int, batch_size: int) -> Timing:
        return Timing.from_samples(
            samples,
            warmup=warmup,
            method=self.method,
            device=str(self.device),
            batch_size=batch_size,
        )


def measure_batches(
    make: Callable[[int], tuple[Callable, Sequence]],
    batch_sizes: Iterable[int],
    **measure_kwargs,
) -> list[Timing]:
    """Throughput per batch size: ``make(batch_size) -> (fn, args)``, each one measured.

    Inputs are built one batch size at a time, so only one set is alive at once.
    """
    timings = []
    for batch_size in batch_sizes:
        fn, args = make(batch_size)
        timings.append(measure(fn, args, batch_size=batch_size, **measure_kwargs))
        del fn, args
    return timings


def _infer_device(tree):
    import torch

    tensors = list(iter_tensors(tree))
    for tensor in tensors:
        if tensor.device.type == "cuda":
            return tensor.device
    return tensors[0].device if tensors else torch.device("cpu")


def iter_tensors(tree):
    """The tensors in ``tree``: nested lists, tuples and mappings (in order)."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from iter_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from iter_tensors(value)


def _host_synchronizer(device) -> Callable[[], None] | None:
    """How to wait for ``device``'s queued work from the host; None for the CPU."""
    import torch

    if device.type == "cpu":
        return None
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is None or current.type != device.type:
        raise ValueError(
            f"device {device}: bladesmith cannot synchronise this device from torch, so "
            "host timings would miss its queued work; time it through its own runtime "
            "(for DirectML, ONNX Runtime's session.run is synchronous)"
        )
    return lambda: accelerator.synchronize(device)


def _time_cuda(call, iters, device, done) -> list[float]:
    import torch

    stream = torch.cuda.current_stream(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for count, (start, end) in enumerate(events, 1):
        start.record(stream)
        call()
        end.record(stream)
        if done is not None:
            done(count)
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _report(progress, stage, done, total) -> None:
    if progress is not None:
        progress(stage, done, total)
