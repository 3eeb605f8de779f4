"""optimize on a detector: the passes kept, torchvision's structure, the user's model untouched."""

from __future__ import annotations

import copy

import pytest
import torch

import bladesmith
from bladesmith.config import Config
from bladesmith.engine.reference import reference_under_noise
from bladesmith.passes import registry
from bladesmith.passes.cuda_graph import CudaGraph
from bladesmith.verify import compare_detections
from engine_testing import (
    IMAGE_SIZE,
    Memoized,
    cuda,
)

QUICK = Config(warmup=0, iters=2)


@pytest.fixture(scope="module")
def optimized_detector(retinanet, photos):
    """The detector optimized on the CPU with every accurate pass kept (the built-in
    passes, then one that makes the result fast whatever the machine's load). winograd
    is left out: whether it switches a convolution depends on timing (its own tests);
    bf16 too: whether it is tried depends on the CPU (its own tests); the other runtimes
    (ONNX Runtime, OpenVINO), which would replace TorchScript (their own tests)."""
    state = {k: v.clone() for k, v in retinanet.state_dict().items()}
    passes = [*registry.create_all(), Memoized()]
    result = bladesmith.optimize(
        retinanet,
        device="cpu",
        test_data=[(photos,)],
        config=Config(
            warmup=0,
            iters=1,
            exclude=["onnxruntime", "openvino", "openvino_f32", "winograd", "bf16"],
            min_speedup=1e-6,
        ),
        passes=passes,
    )
    return (*result, state)


@pytest.mark.slow
def test_detector_keeps_torchvision_structure_and_detections(retinanet, photos, optimized_detector):
    optimized, spec, report, _ = optimized_detector
    expected = ("fixed_shape", "norm_folding", "channels_last", "torchscript", "memoized")
    assert spec.passes == expected, [(r.name, r.status, r.reason) for r in report.optimizations]
    assert spec.output == "detections" and spec.backend == "torchscript"
    assert optimized.candidate.runner_passes == ("torchscript", "memoized")
    assert spec.input_shapes == ((1, 3, *IMAGE_SIZE),)
    detections = optimized(photos)
    assert isinstance(detections, list) and set(detections[0]) == {"boxes", "scores", "labels"}
    with torch.no_grad():
        assert compare_detections(retinanet(photos), detections).passed
    assert report.accuracy["passed"]
    assert "candidates over the score threshold per level" in report.diagnosis["message"]
    assert "realistic load" in report.diagnosis["message"]

    boxes, scores, labels, count = optimized.as_padded()(torch.stack(photos))
    assert boxes.shape == (1, retinanet.detections_per_img, 4) and boxes.dtype == torch.float32
    assert labels.dtype == count.dtype == torch.int64
    assert count.tolist() == [len(d["scores"]) for d in detections]


@pytest.mark.slow
def test_detector_optimization_leaves_the_users_model_untouched(retinanet, optimized_detector):
    optimized, _, _, state = optimized_detector
    assert retinanet.state_dict().keys() == state.keys()
    for name, value in retinanet.state_dict().items():
        assert torch.equal(value, state[name]), name
        assert value.is_contiguous(), name  # channels_last went to a copy
    assert all(p is not q for p in retinanet.parameters() for q in optimized.parameters())


@cuda
def test_gpu_passes_on_a_detector(retinanet, photos):
    optimized, spec, report = bladesmith.optimize(
        retinanet, device="cuda", test_data=[(photos,)], config=QUICK
    )
    records = {record.name: record for record in report.optimizations}
    assert records["cuda_graph"].status != "failed", records["cuda_graph"].reason
    assert records["inductor"].status != "failed", records["inductor"].reason
    assert report.accuracy["passed"]
    gate = next(o for o in report.accuracy["outputs"].values() if o["kind"] == "detections")
    # The result run again, judged at the numbers the gate states and by its rules. The
    # model as given runs its convolutions in TF32 on the GPU: the gate measures what that
    # rounding moves and excuses what the model's own rounding noise flips. Held instead to
    # float32's defaults (scores within 5e-3, nothing excused), an H200 run failed with a
    # score moved 8.4e-3 and F1 0.9899, a rule the gate never claimed.
    model = copy.deepcopy(retinanet).cuda()
    inputs = [p.cuda() for p in photos]
    with torch.no_grad():
        expected = model(inputs)
        noisy = reference_under_noise(model, [(inputs,)])
    again = compare_detections(
        expected,
        optimized(photos),
        iou_threshold=gate["iou_threshold"],
        min_f1=gate["min_f1"],
        score_atol=gate["score_atol"],
        noisy=[run[0] for run in noisy],
    )
    assert again.passed, again.summary()
    assert gate["score_atol"] <= 0.1 and gate["min_f1"] >= 0.99 and gate["iou_threshold"] >= 0.9
    assert CudaGraph.name in spec.passes or records["cuda_graph"].status == "rejected"
