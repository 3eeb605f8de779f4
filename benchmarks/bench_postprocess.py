"""RetinaNet post-processing, torchvision against bladesmith's operators, side by side.

    python benchmarks/bench_postprocess.py [--device cuda|cpu] [--dtype float32|float16|bfloat16]
                                           [--quick] [--json PATH] [--profile]

The load is that of a 480x640 image through torchvision's RetinaNet: five levels (P3-P7)
of 9 anchors per position (N_l = 43200, 10800, 2700, 720, 180; 57,600 anchors), anchors
from the model's own AnchorGenerator, 80 classes, random box deltas, and logits drawn per level
so that about 3,000 of each level's logits pass the score threshold (at least 1,000), as for
a trained model on a busy image.
Settings are torchvision's RetinaNet defaults: score threshold 0.05, top-k 1000, IoU 0.5,
300 detections.

Rows: torchvision's RetinaNet.postprocess_detections (from a real RetinaNet) against
bladesmith's retinanet_postprocess at two batch sizes; torchvision.ops.batched_nms against
bladesmith's batched_nms on 5,000 candidates; bladesmith's decode alone. Each is the median
of many runs timed with CUDA events (perf_counter on the CPU), eager and, on CUDA, as a
CUDA graph replay. Inputs rotate among several sets so that repeated runs do not all read
from the L2 cache. Every row first checks that the detections agree with torchvision's.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch
import torchvision
from torchvision.models.detection import retinanet_resnet50_fpn
from torchvision.models.detection.image_list import ImageList

from bladesmith.bench import measure
from bladesmith.ops import batched_nms, load_library, retinanet_decode, retinanet_postprocess
from bladesmith.verify import compare_detections

IMAGE = (480, 640)
GRIDS = [(60, 80), (30, 40), (15, 20), (8, 10), (4, 5)]  # P3-P7: strides 8 to 128
NUM_CLASSES = 80
THRESHOLD, TOPK, IOU, DETECTIONS = 0.05, 1000, 0.5, 300
# Logits per level: normal with this spread, shifted so that this many pass on average.
LOGIT_STD, PASSING_PER_LEVEL = 2.0, 3000
INPUT_SETS = 3
# Targets on CUDA: postprocess speed-up at batch 1, latencies in ms.
MIN_SPEEDUP, POSTPROCESS_B1_AIM_MS, POSTPROCESS_B32_MS, NMS_MS = 15.0, 0.3, 2.0, 0.15
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    case: str
    torchvision_ms: float | None
    eager_ms: float | None
    graph_ms: float | None
    target: str
    met: bool | None
    agreement: str
    logits_bytes: int | None = None  # read by the row's operator

    @property
    def best_ms(self) -> float | None:
        times = [t for t in (self.eager_ms, self.graph_ms) if t is not None]
        return min(times) if times else None

    @property
    def speedup(self) -> float | None:
        if self.torchvision_ms is None or self.best_ms is None:
            return None
        return self.torchvision_ms / self.best_ms

    @property
    def logits_gbps(self) -> float | None:
        """The logits' bytes over the best time: the rate of one pass over them."""
        if self.logits_bytes is None or self.best_ms is None:
            return None
        return self.logits_bytes / self.best_ms / 1e6


def realistic_inputs(model, batch: int, device, dtype, seed: int) -> dict:
    """Head outputs and anchors of the 480x640 geometry, as retinanet_postprocess takes
    them, plus `level_sizes`."""
    generator = model.anchor_generator
    images = ImageList(torch.zeros(1, 3, *IMAGE), [IMAGE])
    features = [torch.zeros(1, 1, h, w) for h, w in GRIDS]
    anchors = generator(images, features)[0]
    per_position = generator.num_anchors_per_location()
    level_sizes = [h * w * a for (h, w), a in zip(GRIDS, per_position)]
    n = sum(level_sizes)
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, n, NUM_CLASSES, generator=g, device=device) * LOGIT_STD
    for level in logits.split(level_sizes, dim=1):
        passing = torch.tensor(PASSING_PER_LEVEL / level[0].numel(), dtype=torch.float64)
        level += math.log(THRESHOLD / (1 - THRESHOLD)) + LOGIT_STD * float(
            torch.special.ndtri(passing)
        )
    deltas = torch.randn(batch, n, 4, generator=g, device=device) * 0.5
    return dict(
        cls_logits=logits.to(dtype),
        bbox_deltas=deltas.to(dtype),
        anchors=anchors.to(device, dtype),
        level_sizes=level_sizes,
        image_sizes=torch.tensor([IMAGE] * batch, dtype=torch.int64, device=device),
    )


def torchvision_call(model, inputs):
    """model.postprocess_detections with its inputs split per level, as its forward does."""
    levels = inputs["level_sizes"]
    batch = inputs["cls_logits"].shape[0]
    head = {
        "cls_logits": list(inputs["cls_logits"].split(levels, dim=1)),
        "bbox_regression": list(inputs["bbox_deltas"].split(levels, dim=1)),
    }
    anchors = [list(inputs["anchors"].split(levels))] * batch
    shapes = [IMAGE] * batch
    return lambda: model.postprocess_detections(head, anchors, shapes)


def postprocess_call(inputs):
    return lambda: retinanet_postprocess(
        **inputs,
        score_threshold=THRESHOLD,
        topk_candidates=TOPK,
        iou_threshold=IOU,
        max_detections=DETECTIONS,
    )


def decode_call(inputs):
    return lambda: retinanet_decode(**inputs, score_threshold=THRESHOLD, topk_candidates=TOPK)


def as_lists(padded) -> list[dict]:
    boxes, scores, labels, counts = padded
    return [
        {"boxes": boxes[b, :n], "scores": scores[b, :n], "labels": labels[b, :n]}
        for b, n in enumerate(counts.tolist())
    ]


def agreement(reference: list[dict], ours: list[dict]) -> str:
    result = compare_detections(reference, ours)
    return f"F1 {result.f1:.4f}" + ("" if result.passed else " FAIL")


def print_kernel_times(name: str, call) -> None:
    from gpu_probe import kernel_times

    print(f"kernels of {name}, per call (us):")
    for kernel, us in kernel_times(call).items():
        print(f"  {us:9.1f}  {kernel}")


def rotate(calls):
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def graphed(calls):
    """Each call captured in its own CUDA graph; replays rotate among them."""
    graphs = []
    for call in calls:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)
    return rotate([graph.replay for graph in graphs])


class Bench:
    def __init__(self, device, quick: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        if quick:
            self.ours_runs, self.torchvision_runs = (2, 5), (1, 3)
        elif self.cuda:
            self.ours_runs, self.torchvision_runs = (20, 200), (3, 20)
        else:
            self.ours_runs, self.torchvision_runs = (2, 10), (1, 5)

    def time(self, call, runs) -> float:
        warmup, iters = runs
        return measure(call, warmup=warmup, iters=iters, device=self.device).p50_ms

    def ours(self, calls) -> tuple[float, float | None]:
        eager = self.time(rotate(calls), self.ours_runs)
        graph = self.time(graphed(calls), self.ours_runs) if self.cuda else None
        return eager, graph


def postprocess_target(batch: int, cuda: bool):
    """(target, check of a Row) for the post-processing rows; targets are for CUDA."""
    if not cuda:
        return "-", None
    if batch == 1:
        target = f">= {MIN_SPEEDUP:g}x (aim < {POSTPROCESS_B1_AIM_MS} ms)"
        return target, lambda row: row.speedup >= MIN_SPEEDUP
    return f"<= {POSTPROCESS_B32_MS} ms", lambda row: row.best_ms <= POSTPROCESS_B32_MS


def target_row(case, reference_ms, eager, graph, target, check, agree, logits_bytes=None) -> Row:
    row = Row(case, reference_ms, eager, graph, target, None, agree, logits_bytes)
    row.met = check(row) if target != "-" else None
    return row


def run(device, dtype, quick: bool, profile: bool = False) -> tuple[list[Row], dict]:
    bench = Bench(device, quick)
    model = retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=NUM_CLASSES
    ).eval()
    model.score_thresh, model.topk_candidates = THRESHOLD, TOPK
    model.nms_thresh, model.detections_per_img = IOU, DETECTIONS
    load_library()
    big_batch = 32 if bench.cuda else 4
    rows = []
    load = {}
    for batch in (1, big_batch):
        sets = [realistic_inputs(model, batch, device, dtype, seed) for seed in range(INPUT_SETS)]
        passing = [
            int((level.float().sigmoid() > THRESHOLD).sum(dim=(1, 2)).min())
            for level in sets[0]["cls_logits"].split(sets[0]["level_sizes"], dim=1)
        ]
        load[f"batch {batch}: fewest candidates over the threshold per level"] = passing
        logits = sets[0]["cls_logits"]
        logits_bytes = logits.numel() * logits.element_size()
        reference = torchvision_call(model, sets[0])()
        agree = agreement(reference, as_lists(postprocess_call(sets[0])()))
        tv_ms = bench.time(
            rotate([torchvision_call(model, s) for s in sets]), bench.torchvision_runs
        )
        eager, graph = bench.ours([postprocess_call(s) for s in sets])
        if profile:
            print_kernel_times(f"retinanet_postprocess, batch {batch}", postprocess_call(sets[0]))
        rows.append(
            target_row(
                f"postprocess B={batch}",
                tv_ms,
                eager,
                graph,
                *postprocess_target(batch, bench.cuda),
                agree,
                logits_bytes,
            )
        )
        eager, graph = bench.ours([decode_call(s) for s in sets])
        rows.append(Row(f"decode B={batch}", None, eager, graph, "-", None, "-", logits_bytes))
        if batch == 1:
            candidates = [decode_call(s)() for s in sets]
            rows.append(nms_row(bench, candidates))
            if profile:
                nms = functools.partial(batched_nms, *candidates[0], IOU, DETECTIONS)
                print_kernel_times("batched_nms", nms)
        del sets, reference
    return rows, load


def nms_row(bench, candidate_sets) -> Row:
    """batched_nms on the 5,000 candidates of one image, against torchvision's."""

    def torchvision_nms(boxes, scores, labels):
        keep = torchvision.ops.batched_nms(boxes[0], scores[0], labels[0], IOU)[:DETECTIONS]
        return boxes[0, keep], scores[0, keep], labels[0, keep]

    count = candidate_sets[0][0].shape[1]
    assert bool((candidate_sets[0][2] != -1).all()), "padding among the NMS candidates"
    tv_boxes, tv_scores, tv_labels = torchvision_nms(*candidate_sets[0])
    reference = [{"boxes": tv_boxes, "scores": tv_scores, "labels": tv_labels}]
    ours = as_lists(batched_nms(*candidate_sets[0], IOU, DETECTIONS))
    tv_ms = bench.time(
        rotate([lambda c=c: torchvision_nms(*c) for c in candidate_sets]), bench.torchvision_runs
    )
    eager, graph = bench.ours(
        [lambda c=c: batched_nms(*c, IOU, DETECTIONS) for c in candidate_sets]
    )
    target = f"<= {NMS_MS} ms" if bench.cuda else "-"
    return target_row(
        f"batched_nms {count} candidates",
        tv_ms,
        eager,
        graph,
        target,
        lambda r: r.best_ms <= NMS_MS,
        agreement(reference, ours),
    )


def fmt(value, spec=".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    columns = [
        "case",
        "torchvision ms",
        "ours eager ms",
        "ours graph ms",
        "speed-up",
        "target",
        "met",
        "agrees with torchvision",
        "logits GB/s",
    ]
    table = [
        [
            r.case,
            fmt(r.torchvision_ms),
            fmt(r.eager_ms),
            fmt(r.graph_ms),
            "-" if r.speedup is None else f"{r.speedup:.1f}x",
            r.target,
            "-" if r.met is None else ("yes" if r.met else "NO"),
            r.agreement,
            fmt(r.logits_gbps, ".0f"),
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *table)]
    for line in [columns, ["-" * w for w in widths], *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--quick", action="store_true", help="a few iterations, to try it out")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--profile", action="store_true", help="CUDA: device time per kernel")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu)")
    device = torch.device(args.device)
    with torch.inference_mode():
        rows, load = run(
            device, DTYPES[args.dtype], args.quick, args.profile and device.type == "cuda"
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"RetinaNet post-processing, 480x640, {NUM_CLASSES} classes, {args.dtype}, on {name} "
        f"(torch {torch.__version__}, torchvision {torchvision.__version__}); medians\n"
        + "\n".join(f"{key}: {value}" for key, value in load.items())
    )
    print_table(rows, header)
    if args.json:
        payload = {
            "device": name,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "load": load,
            "rows": [
                asdict(r)
                | {"speedup": r.speedup, "best_ms": r.best_ms, "logits_gbps": r.logits_gbps}
                for r in rows
            ],
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return 0 if all(r.met is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
