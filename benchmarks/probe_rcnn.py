"""Where a two-stage detector's batch-1 time goes on the GPU, stage by stage (no gate):

    python benchmarks/probe_rcnn.py --family faster_rcnn --passes fixed_shape,fp16,channels_last

The family's fixed-shape pipeline (480x640, bench_families.py's realistic load) with the
passes named applied in order. Each stage is captured as a CUDA graph of its own and
replayed (device time without launch overhead): the backbone, the RPN head, the whole
proposal step, RoI pooling, the box head, the whole detection step and the whole call.
Then each kernel's device time in one uncaptured call, by the op that launched it, the
top 30 printed (all into $OUT/rcnn_kernels_FAMILY_DTYPE.txt). With --compile each stage
is compiled by Inductor first, frozen weights and static shapes as the inductor pass
compiles the whole model, so the figures are those of o1's fused kernels.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from bench_families import BUILDERS
from bladesmith.config import Config
from bladesmith.images import sample_images
from bladesmith.passes import Candidate, Context
from bladesmith.passes.registry import create_all

SIZE = (480, 640)


def main() -> None:
    parser = argparse.ArgumentParser()
    rcnns = [name for name in BUILDERS if "rcnn" in name]
    parser.add_argument("--family", default="faster_rcnn", choices=rcnns)
    parser.add_argument("--passes", default="fixed_shape,fp16,channels_last,conv_fusion")
    parser.add_argument("--compile", action="store_true", help="each stage through Inductor")
    args = parser.parse_args()
    torch._inductor.config.freezing = args.compile
    dev = torch.device("cuda")
    model = BUILDERS[args.family](SIZE).to(dev).eval()
    images = list(sample_images(1, SIZE, device=dev))
    ctx = Context(
        device=dev, level="o1", config=Config(), example_args=(images,), test_args=[(images,)]
    )
    cand = Candidate(module=model, device=dev)
    passes = {p.name: p for p in create_all()}
    for name in args.passes.split(","):
        cand = passes[name].apply(cand, ctx)
        ctx.kept.append(name)
    pipe = cand.module
    while not hasattr(pipe, "proposals"):
        pipe = pipe.module
    dtype = next(pipe.backbone.parameters()).dtype
    x = images[0].unsqueeze(0).to(dtype)
    if "channels_last" in args.passes:
        x = x.contiguous(memory_format=torch.channels_last)
    print(f"{args.family} {args.passes}: dtype {dtype}", flush=True)
    with torch.no_grad():
        feats = pipe.features(x)
        boxes, valid = pipe.proposals(feats)
        pooled = pipe.pool("box_roi_pool", feats, boxes)
        stages = {
            "backbone": (pipe.features, x),
            "rpn head": (pipe.rpn_head, list(feats.values())),
            "proposals (with rpn head)": (pipe.proposals, feats),
            "box roi pool": (lambda f, b: pipe.pool("box_roi_pool", f, b), feats, boxes),
            "box head + predictor": (lambda p: pipe.box_predictor(pipe.box_head(p)), pooled),
            "detect (pool, head, nms)": (pipe.detect, feats, boxes, valid),
            "whole pipeline": (pipe, x),
        }
        for name, (fn, *inputs) in stages.items():
            fn = torch.compile(fn, dynamic=False) if args.compile else fn
            stages[name] = (fn, *inputs)
            print(f"{name:<28} {replay_us(fn, *inputs):9.1f} us", flush=True)
        whole, image = stages["whole pipeline"]
        tag = f"{args.family}_{str(dtype).removeprefix('torch.')}" + ("_inductor" * args.compile)
        kernels(lambda: whole(image), tag)


def replay_us(fn, *inputs, iters: int = 50) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


OPERATORS = ("aten::", "bladesmith::", "torchvision::")


def op_of(event):
    while event is not None and not event.name.startswith(OPERATORS):
        event = event.cpu_parent
    return event


def kernels(fn, tag: str, calls: int = 5) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows: dict[tuple, float] = {}
    for event in prof.events():
        for k in event.kernels:
            op = op_of(event)
            key = (k.name[:60], op.name if op else "-", str(op.input_shapes)[:140] if op else "")
            rows[key] = rows.get(key, 0.0) + k.duration / calls
    ranked = sorted(rows.items(), key=lambda r: -r[1])
    print(f"uncaptured call: {sum(rows.values()):.1f} us of kernels, {len(ranked)} kinds")
    out = os.environ.get("OUT", "/tmp")
    with open(f"{out}/rcnn_kernels_{tag}.txt", "w") as f:
        for (kernel, op, shapes), us in ranked:
            f.write(f"{us:8.1f}  {kernel}  | {op} {shapes}\n")
    for (kernel, op, shapes), us in ranked[:30]:
        print(f"{us:8.1f}  {kernel[:45]}  | {op} {shapes[:100]}")


if __name__ == "__main__":
    main()
