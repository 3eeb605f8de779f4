"""Where batch 1's time goes on the GPU, for one combination of passes (no accuracy gate):

    python benchmarks/probe_batch1.py fixed_shape,head_packing,fp16,channels_last,inductor
    python benchmarks/probe_batch1.py PASSES --parts 3,5    # only some parts

1. each kernel's device time with the op and input shapes that launched it (compiled, no
   CUDA graph), into $OUT/kernels_by_op.txt (the top 25 printed);
2. the kernels of one CUDA graph replay in order, into $OUT/graph_sequence.txt;
3. what the call costs around the graph: replay alone back to back, with a host
   synchronisation, with the input copy, through the runner, padded and as a list;
4. retinanet_postprocess alone on this model's own candidates, at batch 1 and the same
   candidates repeated to batch 32, as CUDA graph replays (bench_postprocess's graphed);
5. one list call's timeline: the host's runtime calls and the device's kernels, in us
   from the call's start, into $OUT/call_timeline.txt (a summary printed);
6. graph launch latency against the number of kernels, on graphs of tiny kernels.
"""

import argparse
import os
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench_postprocess import graphed
from bladesmith.artifact import OptimizedModule
from bladesmith.bench import measure
from bladesmith.config import Config
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet
from bladesmith.passes import Candidate, Context
from bladesmith.passes.registry import create_all
from bladesmith.runtimes.cuda_graph import CudaGraphRunner

parser = argparse.ArgumentParser()
parser.add_argument("passes", help="comma-separated passes, applied in order")
parser.add_argument("--parts", default="1,2,3,4,5,6", help="comma-separated parts to run")
args = parser.parse_args()
parts = {int(p) for p in args.parts.split(",")}
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
model = build_retinanet((480, 640)).to(dev).eval()
images = list(sample_images(1, (480, 640), device=dev))
batch = images[0].unsqueeze(0)
passes = {p.name: p for p in create_all()}
ctx = Context(
    device=dev, level="o1", config=Config(), example_args=(images,), test_args=[(images,)]
)
cand = Candidate(module=model, device=dev)
for n in args.passes.split(","):
    cand = passes[n].apply(cand, ctx)
    ctx.kept.append(n)
print("notes:", ctx.notes, flush=True)

pipe = cand.module
while not hasattr(pipe, "head_outputs"):
    pipe = pipe.module
with torch.no_grad():
    cls, deltas = pipe.head_outputs(batch.to(next(pipe.parameters()).dtype), torch.float32)


def op_of(evt):
    e = evt
    while e is not None and not (e.name.startswith("aten::") or e.name.startswith("bladesmith::")):
        e = e.cpu_parent
    return e


def kernels_by_op():
    """1. kernels by launching op and shapes (compiled, no graph)"""
    with torch.no_grad():
        for _ in range(3):
            cand(batch)
        torch.cuda.synchronize()
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
        ) as prof:
            for _ in range(5):
                cand(batch)
            torch.cuda.synchronize()
    rows = {}
    for evt in prof.events():
        for k in evt.kernels:
            op = op_of(evt)
            key = (k.name[:70], op.name if op else "-", str(op.input_shapes)[:160] if op else "")
            rows[key] = rows.get(key, 0.0) + k.duration / 5
    total = sum(rows.values())
    print(f"no-graph kernels: {total:.1f} us/call")
    ranked = sorted(rows.items(), key=lambda r: -r[1])
    with open(f"{OUT}/kernels_by_op.txt", "w") as f:
        for (kn, opn, shapes), us in ranked:
            f.write(f"{us:8.1f}  {kn}  | {opn} {shapes}\n")
    for (kn, opn, shapes), us in ranked[:25]:
        print(f"{us:8.1f}  {kn[:50]}  | {opn} {shapes[:110]}")


def graph_sequence(entry):
    """2. graph: ordered kernels of one replay"""
    with torch.no_grad():
        for _ in range(5):
            entry.graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            entry.graph.replay()
            torch.cuda.synchronize()
    dev_events = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    with open(f"{OUT}/graph_sequence.txt", "w") as f:
        t0 = dev_events[0].time_range.start if dev_events else 0
        for e in dev_events:
            f.write(
                f"{e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:120]}\n"
            )
    print(
        f"graph: {len(dev_events)} kernels, span "
        f"{dev_events[-1].time_range.end - dev_events[0].time_range.start:.1f} us, "
        f"busy {sum(e.time_range.elapsed_us() for e in dev_events):.1f} us",
        flush=True,
    )


def t(name, fn, arg, iters=300):
    r = measure(fn, (arg,), warmup=50, iters=iters, device=dev, batch_size=1)
    print(f"{name:<44} mean {r.mean_ms * 1e3:8.1f} us  p50 {r.p50_ms * 1e3:8.1f} us", flush=True)
    return r


def host_us(fn, calls=200):
    """Host time of fn() alone, the device idle before each call."""
    total = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / calls * 1e6


def call_overheads(runner, entry, mod, padded):
    """3. what the call costs around the graph"""
    static = entry.static_inputs[0]

    def replay_only(_):
        entry.graph.replay()

    def replay_sync(_):
        entry.graph.replay()
        torch.cuda.current_stream().synchronize()

    def copy_replay_sync(x):
        static.copy_(x)
        entry.graph.replay()
        torch.cuda.current_stream().synchronize()

    def copy_sync_replay_sync(x):
        static.copy_(x)
        torch.cuda.current_stream().synchronize()
        entry.graph.replay()
        torch.cuda.current_stream().synchronize()

    def runner_sync(x):
        runner(x)
        torch.cuda.current_stream().synchronize()

    def raw_list(x):
        static.copy_(x)
        entry.graph.replay()
        boxes, scores, labels, n = (o.clone() for o in entry.static_outputs)
        return [
            {"boxes": boxes[i, :c], "scores": scores[i, :c], "labels": labels[i, :c]}
            for i, c in enumerate(n.tolist())
        ]

    with torch.no_grad():
        t("replay only (back to back)", replay_only, batch)
        t("replay + sync", replay_sync, batch)
        t("copy + replay + sync", copy_replay_sync, batch)
        t("copy + sync + replay + sync", copy_sync_replay_sync, batch)
        t("runner + sync", runner_sync, batch)
        t("padded module (back to back)", padded, images)
        t("raw list (copy, replay, 4 clones, tolist)", raw_list, batch)
        t("list module", mod, images)
        t("list module again", mod, images)
        t("padded module again", padded, images)
        print(f"host: graph.replay() {host_us(entry.graph.replay):.1f} us", flush=True)
        print(f"host: input copy_ {host_us(lambda: static.copy_(batch)):.1f} us")
        print(f"host: runner(batch) {host_us(lambda: runner(batch)):.1f} us")
        print(f"host: list module {host_us(lambda: mod(images)):.1f} us (to its return)")


def postprocess_alone():
    """4. post-processing alone on this model's candidates"""
    for B in (1, 32):
        cls_b = cls.expand(B, -1, -1).contiguous()
        deltas_b = deltas.expand(B, -1, -1).contiguous()
        sizes = pipe.resized_hw.expand(B, 2).contiguous()

        def postprocess(cls_b=cls_b, deltas_b=deltas_b, sizes=sizes):
            return torch.ops.bladesmith.retinanet_postprocess(
                cls_b,
                deltas_b,
                pipe.anchors,
                pipe.level_sizes,
                sizes,
                pipe.score_threshold,
                pipe.topk_candidates,
                pipe.iou_threshold,
                pipe.max_detections,
                pipe.box_weights,
                pipe.bbox_clip,
            )

        replay = graphed([postprocess])
        with torch.no_grad():
            name = f"postprocess on this model's candidates, batch {B}"
            t(name, lambda _, replay=replay: replay(), None)
        print(f"  kept {postprocess()[3].tolist()[:4]}")


def call_timeline(mod):
    """5. one list call: host runtime calls and device kernels, us from the call's start"""
    with torch.no_grad():
        for _ in range(20):
            mod(images)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.cuda.synchronize()
                with torch.profiler.record_function("list_call"):
                    mod(images)
            torch.cuda.synchronize()
    events = list(prof.events())
    call = [e for e in events if e.name == "list_call" and e.device_type == DeviceType.CPU][-1]
    t0, t1 = call.time_range.start, call.time_range.end
    host = [
        e
        for e in events
        if e.device_type == DeviceType.CPU
        and t0 <= e.time_range.start <= t1
        and (e.name.startswith("cuda") or e.name.startswith("aten::") or e.name == "list_call")
    ]
    device = [e for e in events if e.device_type == DeviceType.CUDA and e.time_range.start >= t0]
    device = [e for e in device if e.time_range.start <= t1 + 5000]
    rows = [("host", e) for e in host] + [("device", e) for e in device]
    rows.sort(key=lambda r: r[1].time_range.start)
    with open(f"{OUT}/call_timeline.txt", "w") as f:
        for side, e in rows:
            f.write(
                f"{side:<6} {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  "
                f"{e.name[:100]}\n"
            )
    print(f"list call on the host: {t1 - t0:.1f} us")
    for side, e in rows:
        if side == "host" and e.name.startswith("cuda") or e is device[0] or e is device[-1]:
            print(
                f"  {side:<6} {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  "
                f"{e.name[:60]}"
            )
    if device:
        print(
            f"  device: first kernel at {device[0].time_range.start - t0:.1f} us, "
            f"last ends at {device[-1].time_range.end - t0:.1f} us, {len(device)} kernels"
        )


def launch_latency():
    """6. graph launch latency against the number of kernels (tiny kernels)"""
    x = torch.zeros(1, device=dev)
    for n in (1, 10, 40, 160, 640):
        replay = graphed([lambda n=n: [x.add_(1) for _ in range(n)]])

        def replay_sync(_, replay=replay):
            replay()
            torch.cuda.current_stream().synchronize()

        back = measure(replay, warmup=50, iters=300, device=dev)
        synced = measure(replay_sync, (None,), warmup=50, iters=300, device=dev)
        print(
            f"graph of {n:4d} kernels: back to back {back.p50_ms * 1e3:7.1f} us, "
            f"with sync {synced.p50_ms * 1e3:7.1f} us, host replay() {host_us(replay):6.1f} us",
            flush=True,
        )


if 1 in parts:
    kernels_by_op()
if parts & {2, 3, 5}:
    runner = CudaGraphRunner(cand, dev)
    runner(batch)
    graph_entry = next(iter(runner.graphs.values()))
    module = OptimizedModule.from_candidate(cand.with_runner(runner, "cuda_graph", wraps=True))
    if 2 in parts:
        graph_sequence(graph_entry)
    if 3 in parts:
        call_overheads(runner, graph_entry, module, module.as_padded())
    if 5 in parts:
        call_timeline(module)
if 4 in parts:
    postprocess_alone()
if 6 in parts:
    launch_latency()
