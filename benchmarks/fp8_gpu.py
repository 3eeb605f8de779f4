"""bladesmith's FP8 result against its fp16 result and torchao used by hand, on the GPU,
in one process.

For each model (random weights; a classifier head drawn at random, since torchvision's
ViT starts its head at zero and every image would then be class 0): the model as given
(float32, eager); bladesmith's fp16 result (level o1: fp16, Inductor, a CUDA graph, as
its report kept them); bladesmith's FP8 result (level o1 with the ``fp8``,
``fp8_static`` and ``fp8_mixed`` passes included, judged by top-1 agreement on held-out
inputs); and,
where torchao is importable, torchao by hand as its documentation shows it (bf16, ``quantize_(model,
Float8DynamicActivationFloat8WeightConfig())``, ``torch.compile(mode="reduce-overhead")``).
They run in ``--rounds`` interleaved rounds of ``--iters`` calls; each line gives the
median of the rounds' median latencies, the speedup over bladesmith's fp16 result (the
median of the rounds' ratios, with their lowest and highest), and the top-1 agreement
with the model as given over ``--agreement`` batches no optimize saw. Also printed: each
optimize's report figure for its saved ``.ptc`` reloaded in a new process.

    python3 benchmarks/fp8_gpu.py [--models vit_b_16,bert_base] [--rounds 10] [--iters 20]
        [--agreement 4] [--search-only] [--json out.json]

Models: torchvision ViT-B/16 at 224x224, batch 32 (photographs from skimage, other views
for agreement); BERT-base (transformers) with a 16-class sequence head, batch 8 x 128
random token ids.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import bladesmith
from bladesmith import bench


class Logits(nn.Module):
    """A transformers classifier's logits alone (one tensor: what top-1 agreement reads)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def build(name: str, seed: int):
    """(model, a function batch index -> its arguments); None when it cannot be built."""
    from bladesmith.images import varied_photos

    torch.manual_seed(0)
    if name == "vit_b_16":
        import torchvision

        model = torchvision.models.vit_b_16().eval()
        nn.init.normal_(model.heads.head.weight, std=0.02)
        return model, lambda i: (varied_photos(32, (224, 224), seed=seed + i),)
    if name == "bert_base":
        try:
            import transformers
        except ImportError:
            return None
        config = transformers.BertConfig(num_labels=16)
        model = Logits(transformers.BertForSequenceClassification(config).eval())
        tokens = torch.Generator().manual_seed(seed)
        return model, lambda i: (
            torch.randint(0, config.vocab_size, (8, 128), generator=tokens.manual_seed(seed + i)),
        )
    raise SystemExit(f"--models: unknown {name}; expected vit_b_16, bert_base")


def torchao_by_hand(model: nn.Module, args: tuple):
    """torchao's FP8 as its documentation shows it, or the reason it cannot run."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    except ImportError as error:
        return None, f"torchao is not importable ({error})"
    quantized = copy.deepcopy(model).to(torch.bfloat16)
    quantize_(quantized, Float8DynamicActivationFloat8WeightConfig())
    compiled = torch.compile(quantized, mode="reduce-overhead")

    def run(*call):
        cast = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in call]
        return compiled(*cast)

    with torch.no_grad():
        for _ in range(3):  # compile, record, replay
            run(*args)
    return run, ""


def torchao_crashes(name: str, seed: int) -> str:
    """Why torchao by hand cannot be timed here, where it ends a process of its own (on
    the GPU machine's torch 2.11 it died of SIGSEGV, taking every figure with it); ''
    where it runs."""
    code = (
        "import runpy, sys, torch; script = runpy.run_path(sys.argv[1]); "
        "model, batch = script['build'](sys.argv[2], int(sys.argv[3])); "
        "args = tuple(x.cuda() for x in batch(0)); "
        "script['torchao_by_hand'](model.cuda(), args)"
    )
    command = [sys.executable, "-c", code, __file__, name, str(seed)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode == 0:
        return ""
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"torchao by hand ended a process of its own with exit {done.returncode} ({last})"


def optimized(model, test_data, include: tuple[str, ...], options):
    started = time.perf_counter()
    config = bladesmith.Config(
        save_as=".ptc", include=include, warmup=options.search_warmup, iters=options.search_iters
    )
    result, spec, report = bladesmith.optimize(
        model, device="cuda", level="o1", test_data=test_data, config=config
    )
    held = [each for each in report.optimizations if each.name in include]
    return result, {
        "passes": list(spec.passes),
        "dtype": spec.dtype,
        "optimize_s": round(time.perf_counter() - started, 1),
        "in_process": "{:.2f}x [{:.2f}-{:.2f}]".format(
            report.diagnosis["speedup"], *report.diagnosis["interval"]
        ),
        "saved": report.diagnosis["saved"],
        "records": [f"{each.name}: {each.status} {each.reason}" for each in held],
    }


def agreement(run, reference, batches: list[tuple]) -> float:
    with torch.no_grad():
        got = torch.cat([run(*each).float().argmax(-1).cpu() for each in batches])
    return float((got == reference).float().mean())


def compared(name: str, options) -> dict:
    built = build(name, options.seed)
    if built is None:
        return {"model": name, "skipped": "transformers is not installed"}
    model, batch = built
    device = torch.device("cuda")
    test_data = [batch(i) for i in range(3)]
    on_device = lambda args: tuple(x.to(device) for x in args)  # noqa: E731
    args = on_device(test_data[0])
    given = copy.deepcopy(model).to(device)
    runs, rows = {"as given": given}, {}
    fp8 = ("fp8", "fp8_static", "fp8_mixed")
    if options.search_only:  # the search's own verdicts: each fp8 pass against the best before
        _, row = optimized(model, test_data, fp8, options)
        return {"model": name, "rows": {"bladesmith fp8": row}}
    runs["bladesmith fp16"], rows["bladesmith fp16"] = optimized(model, test_data, (), options)
    runs["bladesmith fp8"], rows["bladesmith fp8"] = optimized(model, test_data, fp8, options)
    why = torchao_crashes(name, options.seed)
    by_hand, why = (None, why) if why else torchao_by_hand(given, args)
    if by_hand is not None:
        runs["torchao by hand"] = by_hand
    held = [on_device(batch(100 + i)) for i in range(options.agreement)]
    with torch.no_grad():
        reference = torch.cat([given(*each).argmax(-1).cpu() for each in held])
    times = {key: [] for key in runs}
    with torch.no_grad():
        for run in runs.values():
            bench.time_round(run, args, options.iters, device)  # warm-up
        for round_ in range(options.rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for key in order:
                calls = bench.time_round(runs[key], args, options.iters, device)[0]
                times[key].append(statistics.median(calls))  # ms
    base = times["bladesmith fp16"]
    result = {"model": name, "classes": int(reference.unique().numel()), "rows": {}}
    if by_hand is None:
        result["torchao"] = why
    for key, each in times.items():
        ratios = [b / t for b, t in zip(base, each, strict=True)]
        low, mid, high = min(ratios), statistics.median(ratios), max(ratios)
        result["rows"][key] = {
            **rows.get(key, {}),
            "p50_ms": round(statistics.median(each), 3),
            "over_fp16": f"{mid:.2f}x [{low:.2f}-{high:.2f}]",
            "top1_agreement": agreement(runs[key], reference, held),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vit_b_16,bert_base")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--agreement", type=int, default=4, help="held-out batches")
    parser.add_argument("--search-warmup", type=int, default=3)
    parser.add_argument("--search-iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--search-only",
        action="store_true",
        help="only the optimize with the fp8 passes, whose records time them",
    )
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    for name in options.models.split(","):
        try:
            results.append(compared(name, options))
        except Exception as error:  # one model's failure keeps the other's figures
            results.append({"model": name, "failed": f"{type(error).__name__}: {error}"})
        print(json.dumps(results[-1], indent=1, default=str), flush=True)
        if options.json:
            options.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
