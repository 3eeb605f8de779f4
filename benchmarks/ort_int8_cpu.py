"""Why ONNX Runtime's static INT8 loses to its own float32 on the CPU: ResNet-50 exported
once, quantized by ``onnxruntime.quantization.quantize_static`` in each variant below,
and timed against the float32 model in interleaved rounds (same session options).

Variants: QDQ with per-channel S8 weights and U8 activations (the issue's 0.77x), the
same with ``reduce_range`` (7-bit weights: the u8 x s8 multiply-add of AVX2 without VNNI,
``vpmaddubsw``, saturates its 16-bit pairs otherwise, so ORT picks slower kernels),
per-tensor weights, the QOperator format (QLinearConv nodes instead of QDQ pairs ORT
must fuse) and S8 activations, each from the model after ``quant_pre_process`` (shapes
inferred, ORT's graph optimizations applied before the quantizer: batch norms folded;
the raw export's convolution biases are no initializers, which the quantizer fails on).
Each line gives the median latency, the speedup over float32 (median of the rounds'
ratios, lowest and highest), top-1 agreement with float32 on ``--held-out`` views, and
how many Conv nodes ran as an integer kernel in ORT's optimized graph.

    python3 benchmarks/ort_int8_cpu.py [--rounds 8] [--iters 5] [--calibration 16]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torchvision
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

from bladesmith.images import varied_photos
from openvino_vs_bladesmith import interleaved


class Reader(CalibrationDataReader):
    def __init__(self, name: str, images: torch.Tensor):
        self.items = iter([{name: images[i : i + 1].numpy()} for i in range(len(images))])

    def get_next(self):
        return next(self.items, None)


VARIANTS = {
    "QDQ per-channel U8/S8": dict(quant_format=QuantFormat.QDQ, per_channel=True),
    "QDQ per-channel reduce_range": dict(
        quant_format=QuantFormat.QDQ, per_channel=True, reduce_range=True
    ),
    "QDQ per-tensor": dict(quant_format=QuantFormat.QDQ, per_channel=False),
    "QOperator per-channel": dict(quant_format=QuantFormat.QOperator, per_channel=True),
    "QOperator per-channel reduce_range": dict(
        quant_format=QuantFormat.QOperator, per_channel=True, reduce_range=True
    ),
    "QDQ per-channel S8/S8": dict(
        quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QInt8
    ),
}


def session(path: Path, threads: int, optimized: Path | None = None):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def kernels(optimized: Path) -> str:
    """The convolution kernels of ORT's optimized graph, counted by op type."""
    graph = onnx.load(str(optimized)).graph
    count = collections.Counter(node.op_type for node in graph.node)
    names = (
        "Conv",
        "FusedConv",
        "QLinearConv",
        "ConvInteger",
        "QuantizeLinear",
        "DequantizeLinear",
    )
    return ", ".join(f"{name} {count[name]}" for name in names if count[name])


def classes(run, views: torch.Tensor) -> np.ndarray:
    """The top-1 class of each view, one call each."""
    return np.concatenate([run.run(None, {"x": view[None].numpy()})[0] for view in views]).argmax(
        -1
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--calibration", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = varied_photos(1, (224, 224))
    calibration = varied_photos(options.calibration + 1, (224, 224), seed=5)[1:]
    views = varied_photos(options.held_out + 1, (224, 224), seed=123)[1:]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        fp32 = folder / "fp32.onnx"
        torch.onnx.export(model, (x,), str(fp32), input_names=["x"], dynamo=False, opset_version=17)
        pre = folder / "pre.onnx"
        quant_pre_process(str(fp32), str(pre))
        paths = {"float32": fp32}
        for name, settings in VARIANTS.items():
            # From the pre-processed model: the raw export's convolution biases are not
            # initializers, which quantize_static cannot read (AttributeError).
            paths[name] = folder / f"{len(paths)}.onnx"
            quantize_static(str(pre), str(paths[name]), Reader("x", calibration), **settings)
        sessions, graphs = {}, {}
        for name, path in paths.items():
            graphs[name] = path.with_suffix(".opt.onnx")
            sessions[name] = session(path, options.threads, graphs[name])
        feed = {"x": x.numpy()}
        runs = {name: (lambda s=s: s.run(None, feed)) for name, s in sessions.items()}
        result = interleaved(runs, options.rounds, options.iters)
        reference = np.concatenate(
            [
                sessions["float32"].run(None, {"x": views[i : i + 1].numpy()})[0]
                for i in range(len(views))
            ]
        ).argmax(-1)
        base = result["float32"][1]
        print(f"ONNX Runtime {ort.__version__}, {options.threads} threads, batch 1, 224x224")
        for name, (times, medians) in result.items():
            ratios = [b / m for b, m in zip(base, medians, strict=True)]
            top1 = np.concatenate(
                [
                    sessions[name].run(None, {"x": views[i : i + 1].numpy()})[0]
                    for i in range(len(views))
                ]
            ).argmax(-1)
            print(
                f"  {name:<38} p50 {statistics.median(times) * 1e3:7.2f} ms  "
                f"{statistics.median(ratios):4.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]  "
                f"top-1 {float((top1 == reference).mean()):.2f}  [{kernels(graphs[name])}]",
                flush=True,
            )


if __name__ == "__main__":
    main()
