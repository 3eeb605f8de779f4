"""fp16/bf16: a copy in half precision that returns float32."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from bladesmith.passes import Candidate
from bladesmith.passes.precision import AutocastFloats, BFloat16, CastFloats, Float16
from engine_testing import (
    context_for,
)


def test_half_precision_wraps_a_copy_and_returns_float32():
    model = nn.Linear(4, 2)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    context = context_for((torch.randn(3, 4),))
    assert Float16().skip_reason(candidate, context) is None
    assert "fp16 was kept" in BFloat16().skip_reason(candidate, context_for((), kept=["fp16"]))
    half = BFloat16().apply(candidate, context)
    assert isinstance(half.module, CastFloats) and half.dtype == torch.bfloat16
    assert half.module.module.weight.dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32  # the candidate given is untouched
    out = half(torch.randn(3, 4))
    assert out.dtype == torch.float32
    assert "computes in bfloat16, not float32" in Float16().skip_reason(half, context)


class MeanSubtracted(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.full((1, 3, 1, 1), 0.5))

    def forward(self, x):
        return self.conv(x - self.mean.to(x.dtype)).relu()


def test_a_trace_with_float32_casts_runs_under_autocast():
    """Traced on float32 inputs, ``mean.to(x.dtype)`` casts to float32 for good: the
    half copy meets float32 activations and fails, so the pass runs the model (weights
    untouched) under torch.autocast, in bfloat16 convolutions."""
    torch.manual_seed(0)
    eager = MeanSubtracted().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        traced = torch.jit.trace(eager, (x,))
    candidate = Candidate(module=traced, device=torch.device("cpu"))
    context = context_for((x,))
    half = BFloat16().apply(candidate, context)
    assert isinstance(half.module, AutocastFloats) and half.dtype == torch.bfloat16
    assert half.module.module is traced and traced.conv.weight.dtype == torch.float32
    assert any("torch.autocast" in note for note in context.notes)
    with torch.no_grad():
        got, expected = half(x), eager(x)
    assert got.dtype == torch.float32
    assert 0 < (got - expected).abs().max() < 0.05  # bfloat16 arithmetic: close, not equal


def test_a_trace_without_baked_casts_is_cast_as_a_module_is():
    x = torch.randn(3, 4)
    with torch.no_grad():
        traced = torch.jit.trace(nn.Linear(4, 2), (x,))
    half = BFloat16().apply(Candidate(module=traced, device=torch.device("cpu")), context_for((x,)))
    assert type(half.module) is CastFloats  # not its autocast subclass


def test_freezing_an_autocast_model_keeps_autocast_outside_the_frozen_graph():
    """A trace drops autocast: the torchscript pass freezes the model inside and runs
    the frozen graph under autocast again, so its convolutions stay in bfloat16."""
    from bladesmith.passes.torchscript import TorchScriptFreeze

    torch.manual_seed(0)
    eager = MeanSubtracted().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        traced = torch.jit.trace(eager, (x,))
    context = context_for((x,))
    half = BFloat16().apply(Candidate(module=traced, device=torch.device("cpu")), context)
    frozen = TorchScriptFreeze().apply(half, context)
    assert isinstance(frozen.runner, AutocastFloats)
    assert isinstance(frozen.runner.module, torch.jit.ScriptModule)
    with torch.no_grad():
        got, expected = frozen(x), eager(x)
    assert got.dtype == torch.float32
    assert 0 < (got - expected).abs().max() < 0.05


def test_bf16_is_tried_on_a_cpu_only_where_it_computes_in_bfloat16(monkeypatch):
    import bladesmith.passes.precision as precision

    candidate = Candidate(module=nn.Linear(4, 2), device=torch.device("cpu"))
    context = context_for((torch.randn(3, 4),))
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert "no bfloat16 arithmetic" in BFloat16().skip_reason(candidate, context)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert BFloat16().skip_reason(candidate, context) is None
    # The probe answers for this machine, whichever it is.
    assert isinstance(precision.cpu_has_bf16(), bool)


def test_bf16_is_skipped_where_torchvisions_nms_has_no_kernel_for_it(monkeypatch):
    """A torchvision detector that fixed_shape did not convert (Keypoint R-CNN) would
    run its own post-processing in bfloat16, and torchvision's nms has no bfloat16
    kernel on a CPU: skipped up front with that reason (it used to fail with the
    kernel's source path)."""
    import torchvision
    from torchvision.ops import nms

    import bladesmith.passes.precision as precision

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)  # whatever this CPU is
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.bfloat16)
    try:
        nms(boxes, boxes[:, 2], 0.5)
    except RuntimeError:
        runs = False
    else:
        runs = True
    assert precision._nms_has_kernel(torch.bfloat16, "cpu") == runs  # the probe is right
    monkeypatch.setattr(precision, "_nms_has_kernel", lambda dtype, device: False)
    model = torchvision.models.detection.keypointrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_keypoints=3
    ).eval()
    candidate = Candidate(module=model, device=torch.device("cpu"))
    context = context_for(([torch.rand(3, 64, 64)],))
    reason = BFloat16().skip_reason(candidate, context)
    assert reason.startswith(
        "torchvision's nms has no bfloat16 kernel on the cpu, and the "
        "model's RegionProposalNetwork would call it"
    ), reason
    plain = Candidate(module=nn.Linear(4, 2), device=torch.device("cpu"))
    assert BFloat16().skip_reason(plain, context) is None


def computes_in_bfloat16(layer) -> bool:
    """Whether ``layer`` computes in bfloat16 (back to float32 after): wrapped, or a
    Linear layer converted where it is."""
    in_bfloat16 = all(p.dtype == torch.bfloat16 for p in layer.parameters())
    if isinstance(layer, nn.Linear):
        with torch.no_grad():
            out = layer(torch.randn(2, layer.in_features))
        return in_bfloat16 and out.dtype == torch.float32
    return (
        isinstance(layer, CastFloats)
        and (layer.dtype, layer.output_dtype) == (torch.bfloat16, torch.float32)
        and in_bfloat16
    )


class SlowInFloat32(nn.Linear):
    """A Linear layer 20 ms slower in float32: bfloat16 always wins the gate's timing and
    the result's, whatever this CPU's matrix products and load (not traced: a save runs
    as fast either way)."""

    def forward(self, x):
        if self.weight.dtype == torch.float32:
            time.sleep(0.02)
        return super().forward(x)


@pytest.mark.slow
def test_linear_bf16_runs_the_linear_layers_alone_in_bfloat16_and_saves(tmp_path, monkeypatch):
    import bladesmith
    import bladesmith.passes.precision as precision
    from bladesmith import fresh_load
    from bladesmith.config import Config
    from bladesmith.passes.precision import LinearBFloat16

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)  # whatever this CPU is
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 64), nn.ReLU())
    model.append(SlowInFloat32(64, 5))
    x = torch.rand(2, 3, 8, 8)
    context = context_for((x,))
    candidate = Candidate(module=model, device=torch.device("cpu"))
    assert LinearBFloat16().skip_reason(candidate, context) is None
    mixed = LinearBFloat16().apply(candidate, context)
    assert mixed.dtype == torch.bfloat16
    assert isinstance(mixed.module[0], nn.Conv2d) and mixed.module[0].weight.dtype == torch.float32
    assert all(computes_in_bfloat16(mixed.module[i]) for i in (2, 4))
    assert model[2].weight.dtype == torch.float32 and not model[2]._forward_hooks  # untouched
    with torch.no_grad():
        out, expected = mixed(x), model(x)
    assert out.dtype == torch.float32 and not torch.equal(out, expected)
    torch.testing.assert_close(out, expected, rtol=5e-2, atol=2e-2)
    no_linear = Candidate(module=nn.Conv2d(3, 4, 3), device=torch.device("cpu"))
    assert "no Linear layer" in LinearBFloat16().skip_reason(no_linear, context)
    assert "not float32" in LinearBFloat16().skip_reason(mixed, context)

    # Through the gate, saved, and run in a new process with the same outputs.
    config = Config(warmup=0, iters=2, min_speedup=1e-6)
    optimized, spec, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=config, passes=[LinearBFloat16()]
    )
    assert spec.passes == ("linear_bf16",) and spec.dtype == "bfloat16"
    outputs, problem = fresh_load.run_saved(bladesmith.save(optimized, tmp_path / "m.pt"), (x,))
    assert problem is None
    torch.testing.assert_close(outputs, optimized(x))


def _transformers():
    import torchvision

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    ).eval()
    nn.init.normal_(vit.heads.head.weight, std=0.02)  # torchvision's is all zeros
    return [(layer, torch.randn(2, 16, 64)), (vit, torch.rand(2, 3, 32, 32))]


def test_linear_bf16_runs_a_transformers_mlps_in_bfloat16_and_leaves_attention_alone(
    monkeypatch,
):
    """nn.MultiheadAttention reads its out_proj's weight itself (a wrapped out_proj had
    none: AttributeError), and nn.TransformerEncoderLayer's fused path reads linear1's and
    linear2's: the MLPs compute in bfloat16, out_proj stays float32, and the pass runs
    through the gate."""
    import bladesmith
    import bladesmith.passes.precision as precision
    from bladesmith.config import Config
    from bladesmith.passes.precision import LinearBFloat16

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)  # whatever this CPU is
    for model, x in _transformers():
        context = context_for((x,))
        mixed = LinearBFloat16().apply(Candidate(module=model, device=torch.device("cpu")), context)
        attention = [m for m in mixed.module.modules() if isinstance(m, nn.MultiheadAttention)]
        assert attention and all(a.out_proj.weight.dtype == torch.float32 for a in attention)
        mlps = [
            m
            for m in mixed.module.modules()
            if isinstance(m, nn.Linear) and all(m is not a.out_proj for a in attention)
        ]
        assert mlps and all(computes_in_bfloat16(m) for m in mlps)
        with torch.no_grad():
            out, expected = mixed(x), model(x)
        assert out.dtype == torch.float32 and not torch.equal(out, expected)
        torch.testing.assert_close(out, expected, rtol=5e-2, atol=5e-2)

        config = Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)
        _, spec, report = bladesmith.optimize(
            model, device="cpu", test_data=[(x,)], config=config, passes=[LinearBFloat16()]
        )
        (record,) = report.optimizations
        assert record.status != "failed", record.reason


@pytest.mark.slow
def test_roi_heads_bf16_runs_a_two_stage_detectors_heads_alone_in_bfloat16_and_saves(
    tmp_path, monkeypatch
):
    """Faster R-CNN v2 (its box head: four 3x3 convolutions and a Linear layer per
    proposal): the heads the pipeline names run in bfloat16, the backbone and the RPN in
    float32; through the gate, saved, and run in a new process with the same outputs."""
    import bladesmith
    import bladesmith.passes.precision as precision
    from bladesmith import fresh_load
    from bladesmith.config import Config
    from bladesmith.families.rcnn import FasterRCNNPipeline, build_rcnn
    from bladesmith.images import sample_images
    from bladesmith.passes.precision import RoIHeadsBFloat16
    from bladesmith.verify import compare_detections
    from bladesmith.verify.tolerance import detection_score_tolerance

    computes_in_bf16 = precision.cpu_has_bf16()
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)  # whatever this CPU is
    size = (128, 160)
    small = dict(num_classes=5, rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=50)
    model = build_rcnn("fasterrcnn_resnet50_fpn_v2", size, **small)
    images = sample_images(1, size)
    context = context_for((images,))
    pipeline = Candidate(module=FasterRCNNPipeline(model, size), device=torch.device("cpu"))
    assert RoIHeadsBFloat16().skip_reason(pipeline, context) is None
    mixed = RoIHeadsBFloat16().apply(pipeline, context)
    assert mixed.dtype == torch.bfloat16
    heads = [getattr(mixed.module, name) for name in FasterRCNNPipeline.roi_heads]
    assert all(computes_in_bfloat16(head) for head in heads)
    assert next(heads[0].parameters()).dtype == torch.bfloat16
    assert next(mixed.module.backbone.parameters()).dtype == torch.float32
    assert not computes_in_bfloat16(model.roi_heads.box_head)  # the model is untouched
    with torch.no_grad():
        boxes, scores, labels, num = mixed(images)
        expected = pipeline(images)
    assert boxes.dtype == scores.dtype == torch.float32 and int(num[0]) > 0
    assert not torch.equal(scores, expected[1])  # rounded differently
    plain = Candidate(module=nn.Linear(3, 3), device=torch.device("cpu"))
    assert "no RoI heads" in RoIHeadsBFloat16().skip_reason(plain, context)
    assert "not float32" in RoIHeadsBFloat16().skip_reason(mixed, context)

    if not computes_in_bf16:  # emulated, bfloat16 is slower (0.27x measured): rightly dropped
        pytest.skip("this CPU has no bfloat16 instructions: the pass is not kept here")
    config = Config(warmup=0, iters=2, min_speedup=1e-6, exclude=("bf16", "winograd"))
    optimized, spec, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(list(images),)], config=config
    )
    assert "roi_heads_bf16" in spec.passes and spec.dtype == "bfloat16", spec.passes
    outputs, problem = fresh_load.run_saved(
        bladesmith.save(optimized, tmp_path / "m.pt"), (list(images),)
    )
    assert problem is None
    # The frozen file and the module in process round bfloat16 differently: the same
    # detections as the gate judges them at bfloat16's tolerance.
    same = compare_detections(
        optimized(list(images)), outputs, score_atol=detection_score_tolerance(torch.bfloat16)
    )
    assert same.passed, same


@pytest.mark.slow
def test_roi_heads_bf16_runs_torchvisions_own_roi_heads_in_bfloat16(monkeypatch):
    """A torchvision detector that fixed_shape does not convert (Keypoint R-CNN): the
    heads of torchvision's RoIHeads (it calls them as layers) run in bfloat16; before,
    the pass iterated over the RoIHeads module itself (TypeError)."""
    import torchvision

    import bladesmith
    import bladesmith.passes.precision as precision
    from bladesmith.config import Config
    from bladesmith.passes.precision import RoIHeadsBFloat16

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)  # whatever this CPU is
    torch.manual_seed(0)
    model = torchvision.models.detection.keypointrcnn_resnet50_fpn(
        weights=None,
        weights_backbone=None,
        min_size=64,
        max_size=64,
        num_keypoints=3,
        rpn_pre_nms_top_n_test=50,
        rpn_post_nms_top_n_test=20,
        box_detections_per_img=10,
        box_score_thresh=0.0,  # random weights: keep some detections
    ).eval()
    images = [torch.rand(3, 64, 64)]
    context = context_for((images,))
    candidate = Candidate(module=model, device=torch.device("cpu"))
    assert RoIHeadsBFloat16().skip_reason(candidate, context) is None
    mixed = RoIHeadsBFloat16().apply(candidate, context)
    heads = mixed.module.roi_heads
    names = ("box_head", "box_predictor", "keypoint_head", "keypoint_predictor")
    assert all(computes_in_bfloat16(getattr(heads, name)) for name in names)
    assert heads.mask_head is None  # absent heads stay absent
    assert next(mixed.module.backbone.parameters()).dtype == torch.float32
    assert not computes_in_bfloat16(model.roi_heads.box_head)  # the model is untouched
    with torch.no_grad():
        (out,), (expected,) = mixed(images), model(images)
    assert out.keys() == expected.keys() and len(out["boxes"]) > 0
    assert all(value.dtype == expected[key].dtype for key, value in out.items())

    config = Config(warmup=0, iters=1, min_speedup=1e-6, allow_degenerate=True, progress=False)
    _, _, report = bladesmith.optimize(
        model, device="cpu", test_data=[(images,)], config=config, passes=[RoIHeadsBFloat16()]
    )
    (record,) = report.optimizations
    assert record.status != "failed", record.reason
