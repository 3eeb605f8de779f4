"""What one model instance's runner sustains without the server (GPU): the ceiling of
``bladesmith serve`` for an artifact, and where an execution's time goes.

    python benchmarks/probe_serve_host.py --artifact rn32.pt --image-dtype uint8 --rows 8

The server gives each instance (a process of its own) batches of one-row requests; here
``--processes`` processes each load the artifact into a ``serve.signature.BucketRunner``
and answer such batches of ``--rows`` rows back to back for ``--seconds``, started
together: images/s per process count. One process first times the steps of one batch
(each followed by a device synchronisation): the request checks, the copy into the
staging bucket, the host-to-device copy and conversion, the graph's replay and the
outputs' copy back.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

import bladesmith
from bladesmith.serve.signature import BucketRunner, _stage, _to_numpy, random_rows


def make_runner(artifact: str, image_dtype: str, trust: bool = False):
    bladesmith.ops.load_library()
    module = bladesmith.load(artifact, trust=trust)
    return BucketRunner(module, image_dtype=image_dtype)


def requests_of(runner: BucketRunner, rows: int) -> list[list[np.ndarray]]:
    spec = runner.signature.inputs[0]
    batch = random_rows(np.random.default_rng(0), spec.dtype, (rows, *spec.dims), True)
    return [[batch[i : i + 1]] for i in range(rows)]


def breakdown(runner: BucketRunner, rows: int, repeats: int = 20) -> dict[str, float]:
    """Median milliseconds of each step of one batch of ``rows`` one-row requests."""
    requests = requests_of(runner, rows)
    size = min(s for s in runner.buckets if s >= rows)
    staging = runner._staging[size]
    device = runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps: dict[str, list[float]] = {}

    def timed(name, fn):
        sync()
        start = time.perf_counter()
        value = fn()
        sync()
        steps.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return value

    for _ in range(repeats):
        timed("check", lambda: [runner.signature.check(r) for r in requests])
        timed("stage", lambda: _stage(staging, [r for r in requests], runner.signature.inputs))
        moved = timed(
            "to device, x/255",
            lambda: [as_served(t.to(device, non_blocking=True)) for t in staging],
        )
        with torch.no_grad():
            outputs = timed("replay", lambda moved=moved: runner.run(*moved))
        timed(
            "outputs to host", lambda outputs=outputs: [_to_numpy(v) for v in tree_leaves(outputs)]
        )
        timed("answer (all)", lambda: runner.answer(requests))
    return {name: statistics.median(values) for name, values in steps.items()}


def as_served(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().div_(255) if tensor.dtype == torch.uint8 else tensor


def worker(artifact, image_dtype, trust, rows, seconds, barrier, results):
    runner = make_runner(artifact, image_dtype, trust)
    requests = requests_of(runner, rows)
    for _ in range(3):
        runner.answer(requests)
    barrier.wait()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        runner.answer(requests)
        count += rows
    results.put(count / (time.perf_counter() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--trust", action="store_true", help="as bladesmith.load's")
    parser.add_argument("--image-dtype", default="uint8")
    parser.add_argument("--rows", type=int, default=8, help="one-row requests per execution")
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    runner = make_runner(args.artifact, args.image_dtype, args.trust)
    for rows in sorted({1, args.rows, runner.signature.bucket}):
        steps = breakdown(runner, rows)
        said = ", ".join(f"{name} {ms:.2f}" for name, ms in steps.items())
        print(f"{rows} rows, ms (median of 20): {said}", flush=True)
    del runner
    context = multiprocessing.get_context("spawn")
    for count in map(int, args.processes.split(",")):
        barrier, results = context.Barrier(count), context.Queue()
        workers = [
            context.Process(
                target=worker,
                args=(
                    args.artifact,
                    args.image_dtype,
                    args.trust,
                    args.rows,
                    args.seconds,
                    barrier,
                    results,
                ),
            )
            for _ in range(count)
        ]
        for process in workers:
            process.start()
        rates = [results.get() for _ in workers]
        for process in workers:
            process.join()
        print(
            f"{count} processes, {args.rows} rows per execution: {sum(rates):,.1f} images/s "
            f"({', '.join(f'{r:,.1f}' for r in rates)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
