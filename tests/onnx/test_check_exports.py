"""bladesmith's own ONNX exports pass bladesmith's own check: the RetinaNet pipeline in
standard mode builds in TensorRT (no sequence operators), in domain mode only its custom
node is reported (a plugin or custom-op library must be registered)."""

from __future__ import annotations

import onnx
import pytest
import torch

from bladesmith.onnx.checker import check
from bladesmith.onnx.exporter import export


@pytest.fixture(scope="module")
def retinanet_pipeline():
    from bladesmith.families.retinanet import RetinaNetPipeline
    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    size = (64, 96)
    model = build_retinanet(size, num_classes=3, backbone="resnet18")
    return RetinaNetPipeline(model, size).eval(), sample_images(1, size)


def exported(pipeline, images, path, mode):
    with torch.no_grad():
        return onnx.load(export(pipeline, images, path, custom_ops=mode, input_names=["images"]))


def test_standard_mode_retinanet_passes_the_tensorrt_check(retinanet_pipeline, tmp_path):
    model = exported(*retinanet_pipeline, tmp_path / "standard.onnx", "standard")
    assert not {n.op_type for n in model.graph.node} & {"SplitToSequence", "SequenceAt"}
    findings = check(model, ["tensorrt", "ort-cpu"])
    assert [f.summary() for f in findings if f.severity == "error"] == []


def test_domain_mode_retinanet_reports_only_its_custom_node(retinanet_pipeline, tmp_path):
    model = exported(*retinanet_pipeline, tmp_path / "domain.onnx", "domain")
    findings = check(model, ["tensorrt", "ort-cpu"])
    assert {(f.rule, f.severity) for f in findings} == {("custom-op", "warning")}
    # What runs it, and the export any runtime runs; not onnxruntime-extensions' library alone.
    assert all("only bladesmith.onnx.session runs" in f.message for f in findings)
    assert all("--custom-ops standard" in f.hint for f in findings)
