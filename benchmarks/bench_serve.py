"""Served on Triton against in-process, side by side: throughput and latency per concurrency.

    # GPU: RetinaNet R50-FPN at 480x640 optimized for batch 32, saved with its compiled
    # code, then served (--grpc: requests over gRPC)
    bladesmith optimize --device cuda --batch 32 --out rn32.ptc
    python benchmarks/bench_serve.py --artifact rn32.ptc --trust --instances 2 --json serve.json

    # any machine: torchvision's ResNet-18 (random weights) at 3x32x32, batch 4, on the CPU
    python benchmarks/bench_serve.py --small
    # any machine: what moving the images costs (a net of negligible compute, batch 8)
    python benchmarks/bench_serve.py --transport 480x640 --shared-memory

In-process: the loaded artifact called back to back on full batches of the size it was
built for (its best throughput), one thread. Served: `bladesmith.serve` (Triton, dynamic
batching up to that batch size, run in buckets of it and of the powers of two below it
where the artifact runs at them, ``--instances`` model instances), loaded by client
threads sending one image per request at each concurrency, every answer checked against
the server's answer for the same image alone (``bladesmith loadtest``: wrong answers,
and of those the ones mixed up with another image's; the threads spread over
``--client-processes`` processes, answers checked after the clock stops). The
ratio is served images/s over in-process images/s. Requests go over HTTP, or gRPC with
``--grpc``; ``--shared-memory`` sends the images
through system shared memory (the client's cost of sending them left out: what the
server sustains).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import bladesmith
from bladesmith._files import write_atomically
from bladesmith.serve.loadtest import loadtest
from bladesmith.serve.signature import module_runner


def in_process_images_per_second(module, seconds: float) -> float:
    shapes = module.spec.input_shapes
    batch = shapes[0][0]
    inputs = [
        torch.from_numpy(np.random.default_rng(0).random(s, dtype=np.float32)) for s in shapes
    ]
    run = module_runner(module)
    synchronize = torch.cuda.synchronize if module.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        run(*inputs)
    synchronize()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run(*inputs)
        calls += 1
        if calls % 8 == 0:
            synchronize()
    synchronize()
    return calls * batch / (time.perf_counter() - start)


def small_artifact(folder: Path) -> Path:
    from torchvision.models import resnet18

    from bladesmith.config import Config

    torch.manual_seed(0)
    model = resnet18(weights=None).eval()
    x = torch.rand(4, 3, 32, 32)
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=Config(warmup=1, iters=3), passes=[]
    )
    return bladesmith.save(optimized, folder / "resnet18.pt")


def transport_artifact(folder: Path, size: tuple[int, int]) -> Path:
    """A net whose compute is negligible (pooling and a linear layer) on 3 x size images,
    batch 8: served, it times moving the images."""
    from torch import nn

    from bladesmith.config import Config

    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10)).eval()
    x = torch.rand(8, 3, *size)
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=Config(warmup=1, iters=3), passes=[]
    )
    return bladesmith.save(optimized, folder / "transport.pt")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for each in sockets:
        each.bind(("127.0.0.1", 0))
    ports = [each.getsockname()[1] for each in sockets]
    for each in sockets:
        each.close()
    return ports


def main() -> int:
    from bladesmith.cli.args import input_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", help="a .ptc/.pt2/.pt/.onnx artifact from bladesmith")
    parser.add_argument(
        "--trust", action="store_true", help="as bladesmith serve's: run the code it brings"
    )
    parser.add_argument("--small", action="store_true", help="ResNet-18 at 32x32 on the CPU")
    parser.add_argument(
        "--transport", type=input_size, metavar="HxW", help="a net of negligible compute"
    )
    parser.add_argument("--shared-memory", action="store_true", help="images in shared memory")
    parser.add_argument("--grpc", action="store_true", help="requests over gRPC (default HTTP)")
    parser.add_argument(
        "--image-dtype", choices=("float32", "uint8"), default="float32", help="served images"
    )
    parser.add_argument("--concurrency", default="1,8,32,128", help="default 1,8,32,128")
    parser.add_argument("--requests", type=int, default=1000, help="per concurrency")
    parser.add_argument(
        "--requests-at-1",
        type=int,
        default=200,
        help="at concurrency 1 (default 200: one request at a time is the slowest)",
    )
    parser.add_argument("--instances", type=int, default=1, help="model instances")
    parser.add_argument("--max-queue-delay-us", type=int, default=2000)
    parser.add_argument(
        "--client-processes", type=int, default=8, help="load-generating processes (default 8)"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="in-process timing")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--log", metavar="PATH", help="keep the server's log here")
    args = parser.parse_args()
    if not (args.artifact or args.small or args.transport):
        parser.error("give --artifact PATH, --small or --transport HxW")
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    with tempfile.TemporaryDirectory() as folder:
        if args.artifact:
            artifact = Path(args.artifact)
        elif args.transport:
            artifact = transport_artifact(Path(folder), args.transport)
        else:
            artifact = small_artifact(Path(folder))
        # One this script made is its own; one given is trusted as --trust says.
        trust = args.trust or not args.artifact
        module = bladesmith.load(artifact, trust=trust)
        batch = module.spec.input_shapes[0][0]
        in_process = in_process_images_per_second(module, args.seconds)
        print(f"in-process: {in_process:,.1f} images/s at batch {batch}", flush=True)
        del module  # the server's instances hold their own copies
        http, grpc, metrics = free_ports(3)
        server = bladesmith.serve(
            artifact,
            name="model",
            http_port=http,
            grpc_port=grpc,
            metrics_port=metrics,
            instances=args.instances,
            max_queue_delay_us=args.max_queue_delay_us,
            image_dtype=args.image_dtype,
            block=False,
            trust=trust,
            log=Path(args.log or Path(folder) / "triton.log"),
        )
        try:
            rows = []
            for level in concurrency:  # printed as they come: a cut-off run keeps them
                requests = args.requests_at_1 if level == 1 else args.requests
                [row] = loadtest(
                    server.grpc_url if args.grpc else server.url,
                    "model",
                    concurrency=(level,),
                    requests=requests,
                    shared_memory=args.shared_memory,
                    processes=args.client_processes,
                )
                print(f"served: {row}", flush=True)
                rows.append(row)
        finally:
            server.stop()
    device = "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    protocol = "gRPC" if args.grpc else "HTTP"
    through = f"shared memory ({protocol})" if args.shared_memory else protocol
    print(
        f"{artifact.name} (batch {batch}), {args.instances} instance(s), {device}, "
        f"{args.image_dtype} images through {through}, {args.client_processes} client "
        "process(es)"
    )
    print(
        f"{'concurrency':>11} {'images/s':>10} {'vs in-proc':>10} {'p50 ms':>8} "
        f"{'p90 ms':>8} {'p99 ms':>8} {'wrong':>5} {'mixed up':>8} {'farthest':>8} {'failed':>6} "
        f"{'batch':>6} {'queue ms':>8} {'compute ms':>10}"
    )
    for row in rows:
        print(
            f"{row.concurrency:>11} {row.throughput:>10,.1f} {row.throughput / in_process:>10.2f} "
            f"{row.p50_ms:>8.2f} {row.p90_ms:>8.2f} {row.p99_ms:>8.2f} {row.wrong:>5} "
            f"{row.mixed_up:>8} {row.farthest:>8.4g} {row.failed:>6} {row.batch:>6.2f} "
            f"{row.queue_ms:>8.2f} {row.compute_ms:>10.2f}"
        )
    if args.json:
        result = {
            "artifact": artifact.name,
            "batch": batch,
            "instances": args.instances,
            "device": device,
            "shared_memory": args.shared_memory,
            "protocol": protocol,
            "image_dtype": args.image_dtype,
            "client_processes": args.client_processes,
            "in_process_images_per_s": round(in_process, 2),
            "served": [vars(row) | {"ratio": row.throughput / in_process} for row in rows],
        }
        text = json.dumps(result, indent=2)
        write_atomically(args.json, lambda temporary: temporary.write_text(text))
    return 0 if all(row.wrong == row.failed == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
