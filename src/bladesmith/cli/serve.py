"""`bladesmith serve` and `bladesmith loadtest` (`export triton` is in export.py).

    bladesmith serve rn.pt2 --max-batch 32 --instances 2
    bladesmith loadtest localhost:8000 --model rn --concurrency 1,8,32 --requests 500

Only argparse is imported here; torch and Triton's packages are imported when a command runs.
"""

from __future__ import annotations

import argparse

from bladesmith.cli.args import add_load_library, add_trust_option, at_least, output_file, port


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve a saved artifact on Triton Inference Server",
        description=(
            "Serve ARTIFACT (.pt2, .pt or .onnx written by bladesmith.save or optimize "
            "--out; not a plain `export onnx` file) on Triton Inference "
            "Server (bundled with nvidia-pytriton): HTTP, gRPC and Prometheus metrics, dynamic "
            "batching into the artifact's batch size (partial batches padded), one process "
            "per model instance. Listens on 127.0.0.1 unless --host says otherwise. Stops "
            "on Ctrl-C or SIGTERM: answers the requests that had arrived (computed or "
            "queued), refuses later ones (HTTP 503, gRPC UNAVAILABLE: send them again), "
            "then ends Triton and every process it started; a second Ctrl-C or SIGTERM "
            "ends them at once (exit 1 then, or when the stop was not clean). Only health, "
            "metadata, statistics and inference of the served model are served (see "
            "docs/serving.md), and each request is checked before Triton sees it: one that "
            "is not for the model (names, dtypes, shapes, a batch over --max-batch, a body "
            "that does not hold what it declares) is refused with HTTP 400 / gRPC "
            "INVALID_ARGUMENT. A model instance that dies or is stopped ends the server, "
            "naming it (exit 1)."
        ),
    )
    serve.add_argument("artifact", metavar="ARTIFACT", help=".pt2, .pt or .onnx artifact")
    serve.add_argument("--name", help="model name (default: the file's stem)")
    add_deployment_options(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 (default) is this machine only; 0.0.0.0 is "
        "every interface (reachable from other machines)",
    )
    serve.add_argument("--http-port", type=port, default=8000, help="(default 8000)")
    serve.add_argument("--grpc-port", type=port, default=8001, help="(default 8001)")
    serve.add_argument("--metrics-port", type=port, default=8002, help="(default 8002)")
    serve.add_argument(
        "--max-request-bytes",
        type=at_least(1),
        metavar="BYTES",
        help="refuse (HTTP 400, gRPC INVALID_ARGUMENT) a request whose inputs' declared "
        "shapes hold more bytes, before anything is allocated (default: the model's inputs "
        "times its max batch)",
    )
    serve.add_argument(
        "--shared-memory",
        action="store_true",
        help="serve Triton's shared-memory API (register regions, requests naming them), "
        "to this user's own connections on this machine only; off by default",
    )
    serve.set_defaults(func=run_serve)

    loadtest = subparsers.add_parser(
        "loadtest",
        help="time a served model at several concurrencies",
        description=(
            "Send REQUESTS requests (one row each, distinct rows: a detector's are images, "
            "an integer input's values stay within the model's test data) at each "
            "concurrency and print throughput and p50/p90/p99 latency; every answer is "
            "checked against the answer the server gave the same row alone, so none is lost "
            "or mixed up."
        ),
    )
    loadtest.add_argument("url", metavar="URL", help="host:port (HTTP) or grpc://host:port")
    loadtest.add_argument("--model", help="model name (default: the server's only model)")
    loadtest.add_argument(
        "--concurrency",
        type=_counts,
        default=(1, 8, 32),
        help="requests in flight, comma-separated (default 1,8,32)",
    )
    loadtest.add_argument(
        "--requests", type=at_least(1), default=200, help="requests per concurrency (default 200)"
    )
    loadtest.add_argument(
        "--shared-memory",
        action="store_true",
        help="send the rows through system shared memory (a server on this machine): "
        "what the server sustains, without the cost of sending them",
    )
    loadtest.add_argument(
        "--processes",
        type=at_least(1),
        default=1,
        help="client processes sharing the concurrency (default 1): more where one "
        "Python process cannot send as fast as the server answers",
    )
    loadtest.add_argument(
        "--json", type=output_file(), metavar="PATH", help="also write the table as JSON"
    )
    loadtest.set_defaults(func=run_loadtest)


def add_deployment_options(parser: argparse.ArgumentParser) -> None:
    add_trust_option(parser)
    add_load_library(
        parser, " (besides those saved with the artifact in ARTIFACT.libs/, used without it)"
    )
    parser.add_argument(
        "--max-batch",
        type=at_least(1),
        help="most rows per server-side batch (default: the artifact's batch)",
    )
    parser.add_argument(
        "--max-queue-delay-us",
        type=at_least(0),
        default=500,
        help="longest wait for a batch to fill, in microseconds (default 500)",
    )
    parser.add_argument(
        "--instances", type=at_least(1), default=1, help="model instances per device (default 1)"
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:0,1 (default: the artifact's)")
    parser.add_argument(
        "--image-dtype",
        choices=("float32", "uint8"),
        default="float32",
        help="a detector's images as float32 in [0, 1] or uint8 in [0, 255] (a quarter of "
        "the bytes; scaled on the device) (default float32)",
    )


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,8,32; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1; got {text!r}")
    return counts


def run_serve(args: argparse.Namespace) -> int:
    from bladesmith.serve import serve

    serve(
        args.artifact,
        name=args.name,
        libraries=tuple(args.load_library),
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        max_batch=args.max_batch,
        max_queue_delay_us=args.max_queue_delay_us,
        instances=args.instances,
        device=args.device,
        image_dtype=args.image_dtype,
        max_request_bytes=args.max_request_bytes,
        shared_memory=args.shared_memory,
        trust=args.trust,
    )
    return 0


def run_loadtest(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from bladesmith._files import write_atomically
    from bladesmith.serve.loadtest import loadtest, render

    rows = loadtest(
        args.url,
        args.model,
        concurrency=args.concurrency,
        requests=args.requests,
        shared_memory=args.shared_memory,
        processes=args.processes,
    )
    print(render(rows))
    if args.json:
        text = json.dumps([asdict(row) for row in rows], indent=2)
        write_atomically(args.json, lambda temporary: temporary.write_text(text))
    return 0 if all(row.failed == row.wrong == 0 for row in rows) else 1
