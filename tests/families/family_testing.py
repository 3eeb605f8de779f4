"""Shared by the family tests: torchvision references, order-free comparison of padded
outputs, and the save and export round trips every pipeline must survive."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from contextlib import contextmanager
from importlib.util import find_spec
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torchvision.ops.boxes as box_ops

from bladesmith.onnx import export, session
from bladesmith.ops import library_path
from bladesmith.verify import compare_detections
from ops.ops_testing import assert_same_detections

SETTINGS = ("score_thresh", "topk_candidates", "nms_thresh", "detections_per_img", "box_coder")


@contextmanager
def exact_torchvision_nms():
    """torchvision's batched_nms shifts boxes by label * (max coordinate + 1) for small
    inputs, which rounds coordinates and moves IoUs near the threshold; its per-class path
    for large inputs is the exact form, so references always take that one."""
    with mock.patch.object(box_ops, "_batched_nms_coordinate_trick", box_ops._batched_nms_vanilla):
        yield


def settings_of(model, **overrides) -> SimpleNamespace:
    """The post-processing settings of a one-stage detector, some replaced."""
    values = {name: getattr(model, name) for name in SETTINGS if hasattr(model, name)}
    return SimpleNamespace(**{**values, **overrides})


# torchvision's names of the post-processing settings -> the pipelines' names.
PIPELINE_NAMES = {
    "score_thresh": "score_threshold",
    "topk_candidates": "topk_candidates",
    "nms_thresh": "iou_threshold",
    "detections_per_img": "max_detections",
}


@contextmanager
def pipeline_settings(pipeline, **overrides):
    """``pipeline`` with some settings replaced (torchvision's names), then restored."""
    names = {PIPELINE_NAMES[k]: v for k, v in overrides.items()}
    saved = {name: getattr(pipeline, name) for name in names}
    try:
        for name, value in names.items():
            setattr(pipeline, name, value)
        yield pipeline
    finally:
        for name, value in saved.items():
            setattr(pipeline, name, value)


def as_list(outputs) -> list[dict]:
    boxes, scores, labels, counts = outputs[:4]
    return [
        {"boxes": boxes[i, :n], "scores": scores[i, :n], "labels": labels[i, :n]}
        for i, n in enumerate(counts.tolist())
    ]


def assert_padded_equal_reference(outputs, reference: list[dict], **tolerance) -> None:
    """Padded outputs hold the reference's detections (any order of equal scores),
    descending, then padding (box 0, score 0, label -1); ``tolerance`` goes to
    ``assert_same_detections``."""
    boxes, scores, labels, counts = outputs[:4]
    assert counts.dtype == labels.dtype == torch.int64
    for i, detections in enumerate(reference):
        n = int(counts[i])
        assert (labels[i, n:] == -1).all() and (scores[i, n:] == 0).all()
        assert (boxes[i, n:] == 0).all()
        assert (scores[i, : max(n - 1, 0)] >= scores[i, 1:n]).all()
        assert_same_detections(
            (boxes[i, :n], scores[i, :n], labels[i, :n]), detections, **tolerance
        )


def assert_realistic(reference: list[dict], at_least: int) -> None:
    counts = [len(d["scores"]) for d in reference]
    assert min(counts) >= at_least, f"too few detections to compare: {counts}"


def assert_captured_whole(pipeline, images) -> None:
    """A copy of ``pipeline`` on the GPU, captured in one CUDA graph, gives its
    uncaptured outputs."""
    import copy

    from bladesmith.runtimes.cuda_graph import CudaGraphRunner

    on_gpu = copy.deepcopy(pipeline).cuda().eval()
    images = images.cuda()
    with torch.no_grad():
        expected = on_gpu(images)
    captured = CudaGraphRunner(on_gpu, torch.device("cuda"))
    for got, want in zip(captured(images), expected):
        torch.testing.assert_close(got, want)
    assert len(captured.graphs) == 1


def assert_torchscript_loads_in_a_new_process(pipeline, images, tmp_path, imports=()) -> None:
    """Traced, saved, and loaded with only the operator library (and ``imports``, the
    modules whose operators it calls) in a fresh interpreter, it gives the same outputs."""
    with torch.no_grad():
        traced = torch.jit.trace(pipeline, (images,), check_trace=False)
        expected = pipeline(images)
    traced.save(str(tmp_path / "model.pt"))
    torch.save((images, expected), tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        {"; ".join(f"import {name}" for name in imports)}
        torch.ops.load_library({library_path()!r})
        model = torch.jit.load({str(tmp_path / "model.pt")!r})
        images, expected = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            out = model(images)
        assert len(out) == len(expected)
        for a, b in zip(out, expected):
            assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
            assert torch.allclose(a.float(), b.float(), atol=1e-4), (a - b).abs().max()
        assert not any(name.startswith("bladesmith") for name in sys.modules), "imported"
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def assert_exports(pipeline, images) -> None:
    """torch.export gives one graph whose outputs equal the eager pipeline's."""
    with torch.no_grad():
        program = torch.export.export(pipeline, (images,), strict=False)
        expected = pipeline(images)
        out = program.module()(images)
    for a, b in zip(out, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.allclose(a.float(), b.float(), atol=1e-4)


def assert_onnx_runs_as_pytorch(pipeline, images, tmp_path, mode, output_names) -> None:
    """Exported in ``mode``, ONNX Runtime's detections equal PyTorch's."""
    if mode == "domain" and find_spec("onnxruntime_extensions") is None:
        pytest.skip("domain mode runs through onnxruntime-extensions, not installed here")
    path = export(
        pipeline,
        images,
        tmp_path / f"model-{mode}.onnx",
        custom_ops=mode,
        input_names=["images"],
        output_names=list(output_names),
    )
    with torch.no_grad():
        expected = pipeline(images)
    got = session(path, device="cpu")(images)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in expected]
    comparison = compare_detections(as_list(expected), as_list(got))
    assert comparison.passed, comparison.summary()
    assert comparison.reference_count > 0
    return expected, got
