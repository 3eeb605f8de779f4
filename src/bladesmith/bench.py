"""Timing: warm-up, timed iterations synchronised with the device, percentiles.

On CUDA each iteration is bracketed by a pair of ``torch.cuda.Event`` records on the
current stream and the host synchronises once, after the last one: the events measure
the device's timeline without a host round trip per iteration. Elsewhere each iteration
is timed with ``time.perf_counter``; on accelerators other than CUDA (mps, xpu) the host
synchronises after every iteration, so the clock sees the device's work.

torch is imported inside the functions that need it, so that reading a report (which
uses ``Timing``) does not load it.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# PAI-Blade's tutorial times 100 warm-up and 200 timed runs.
DEFAULT_WARMUP = 100
DEFAULT_ITERS = 200

METHOD_CUDA_EVENTS = "cuda-events"
METHOD_PERF_COUNTER = "perf_counter"

# progress(stage, done, total): stage is "warmup" or "timing"; called after each run.
Progress = Callable[[str, int, int], None]


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
    throughput: float  # items per second: batch_size / mean latency

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
        return cls(
            mean_ms=mean,
            p50_ms=percentile(samples, 50),
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
            throughput=batch_size * 1000.0 / mean if mean > 0 else math.inf,
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
    progress: Progress | None = None,
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed runs, then ``iters`` timed ones.

    ``device`` (a ``torch.device`` or string) picks the clock and the synchronisation;
    when None it is the device of the first CUDA tensor found in the arguments, else
    the first tensor's, else the CPU. ``batch_size`` is the number of items one call
    processes, for the throughput. Grad mode is the caller's: wrap the call in
    ``torch.inference_mode()`` to time inference.
    """
    import torch

    for name, value, least in (
        ("warmup", warmup, 0),
        ("iters", iters, 1),
        ("batch_size", batch_size, 1),
    ):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    kwargs = dict(kwargs or {})
    device = torch.device(device) if device is not None else _infer_device((args, kwargs))

    def call() -> None:
        fn(*args, **kwargs)

    # The collector's pauses would land in random iterations; collect once, then hold it.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        if device.type == "cuda":
            samples = _time_cuda(call, warmup, iters, device, progress)
            method = METHOD_CUDA_EVENTS
        else:
            samples = _time_host(call, warmup, iters, _host_synchronizer(device), progress)
            method = METHOD_PERF_COUNTER
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing.from_samples(
        samples, warmup=warmup, method=method, device=str(device), batch_size=batch_size
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


def _time_host(call, warmup, iters, synchronize, progress) -> list[float]:
    for done in range(1, warmup + 1):
        call()
        _report(progress, "warmup", done, warmup)
    if synchronize is not None:
        synchronize()
    samples = []
    for done in range(1, iters + 1):
        start = time.perf_counter()
        call()
        if synchronize is not None:
            synchronize()
        samples.append((time.perf_counter() - start) * 1000.0)
        _report(progress, "timing", done, iters)
    return samples


def _time_cuda(call, warmup, iters, device, progress) -> list[float]:
    import torch

    with torch.cuda.device(device):
        for done in range(1, warmup + 1):
            call()
            _report(progress, "warmup", done, warmup)
        torch.cuda.synchronize(device)
        stream = torch.cuda.current_stream(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for done, (start, end) in enumerate(events, 1):
            start.record(stream)
            call()
            end.record(stream)
            _report(progress, "timing", done, iters)
        torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _report(progress, stage, done, total) -> None:
    if progress is not None:
        progress(stage, done, total)
