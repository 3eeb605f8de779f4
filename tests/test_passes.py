"""bladesmith's passes, each applied to a small model; the engine's handling of them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes import Candidate, Pass, registry
from bladesmith.passes.channels_last import ChannelsLast
from bladesmith.passes.cuda_graph import CudaGraph
from bladesmith.passes.fixed_shape import FixedShape
from bladesmith.passes.inductor import Inductor, compile_mode
from bladesmith.passes.onnxruntime import OnnxRuntime
from bladesmith.passes.precision import BFloat16, CastFloats, Float16
from bladesmith.passes.torchscript import TorchScriptFreeze
from bladesmith.runtimes.cuda_graph import CudaGraphRunner, _PackedOutputs
from bladesmith.verify import compare_detections
from engine_testing import (
    IMAGE_SIZE,
    Memoized,
    context_for,
    cuda,
    detections_through,
    tiny_detector,
)

QUICK = Config(warmup=0, iters=2)


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)
    ).eval()


@pytest.fixture(scope="module")
def detector():
    return tiny_detector()


@pytest.fixture(scope="module")
def retinanet(detector):
    return detector[0]


@pytest.fixture(scope="module")
def photos(detector):
    return detector[1]


@pytest.fixture(scope="module")
def optimized_detector(retinanet, photos):
    """The detector optimized on the CPU with every accurate pass kept (the built-in
    passes, then one that makes the result fast whatever the machine's load). winograd
    is left out: whether it switches a convolution depends on timing (its own tests)."""
    state = {k: v.clone() for k, v in retinanet.state_dict().items()}
    passes = [*registry.create_all(), Memoized()]
    result = bladesmith.optimize(
        retinanet,
        device="cpu",
        test_data=[(photos,)],
        config=Config(warmup=0, iters=1, exclude=["onnxruntime", "winograd"], min_speedup=0.01),
        passes=passes,
    )
    return (*result, state)


def test_registry_lists_builtin_passes_in_order_and_refuses_duplicates():
    assert registry.names() == [
        "fixed_shape",
        "head_packing",
        "fp16",
        "bf16",
        "winograd",
        "norm_folding",
        "channels_last",
        "conv_fusion",
        "channel_padding",
        "inductor",
        "cuda_graph",
        "torchscript",
        "onnxruntime",
    ]
    summaries = {name: summary for name, _, _, summary in registry.describe()}
    assert all(summaries.values()), summaries

    class Impostor(Pass):
        name = "fp16"

    with pytest.raises(ValueError, match="already registered"):
        registry.register(Impostor)

    class BadLevel(Pass):
        name = "bad_level"
        levels = ("o9",)

    with pytest.raises(ValueError, match="unknown levels"):
        registry.register(BadLevel)


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


def test_detector_optimization_leaves_the_users_model_untouched(retinanet, optimized_detector):
    optimized, _, _, state = optimized_detector
    assert retinanet.state_dict().keys() == state.keys()
    for name, value in retinanet.state_dict().items():
        assert torch.equal(value, state[name]), name
        assert value.is_contiguous(), name  # channels_last went to a copy
    assert all(p is not q for p in retinanet.parameters() for q in optimized.parameters())


def test_fixed_shape_skips_other_models_and_mixed_sizes(retinanet):
    adapter = FixedShape()
    plain = Candidate(module=conv_net(), device=torch.device("cpu"))
    assert "no family of bladesmith.families recognises" in adapter.skip_reason(
        plain, context_for(())
    )
    mixed = [([torch.rand(3, 128, 160)],), ([torch.rand(3, 96, 128)],)]
    context = context_for(mixed[0])
    context.test_args = mixed
    candidate = Candidate(module=retinanet, device=torch.device("cpu"))
    with pytest.raises(bladesmith.passes.PassSkipped, match="several sizes"):
        adapter.apply(candidate, context)


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
    assert "already computes in bfloat16" in Float16().skip_reason(half, context)


def test_channels_last_converts_a_copy_and_skips_models_without_convolutions():
    model = conv_net()
    candidate = Candidate(module=model, device=torch.device("cpu"))
    converted = ChannelsLast().apply(candidate, context_for(()))
    assert converted.module[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model[0].weight.is_contiguous()
    linear = Candidate(module=nn.Linear(2, 2), device=torch.device("cpu"))
    assert "no 2-D convolutions" in ChannelsLast().skip_reason(linear, context_for(()))


def test_torchscript_and_onnxruntime_build_runners_with_the_same_outputs():
    model = conv_net()
    x = torch.randn(2, 3, 16, 16)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    context = context_for((x,))
    scripted = TorchScriptFreeze().apply(candidate, context)
    assert scripted.backend == "torchscript" and scripted.module is model
    torch.testing.assert_close(scripted(x), model(x), rtol=1e-4, atol=1e-5)
    session = OnnxRuntime().apply(scripted, context)
    assert session.applied == ("onnxruntime",)  # replaces the TorchScript runner
    torch.testing.assert_close(session(x), model(x), rtol=1e-4, atol=1e-5)


def test_onnxruntime_keeps_the_output_structure():
    class TwoOutputs(nn.Module):
        def forward(self, x):
            return {"double": x * 2, "pair": (x + 1, x.sum(dim=1))}

    x = torch.randn(2, 3)
    candidate = Candidate(module=TwoOutputs(), device=torch.device("cpu"))
    out = OnnxRuntime().apply(candidate, context_for((x,)))(x)
    torch.testing.assert_close(out["double"], x * 2)
    torch.testing.assert_close(out["pair"][1], x.sum(dim=1))


def test_inductor_mode_by_level_and_skips():
    assert compile_mode("o2") == "max-autotune-no-cudagraphs"
    assert compile_mode("o1") == "default"
    candidate = Candidate(module=nn.Linear(2, 2), device=torch.device("cpu"))
    assert "level o2" in Inductor().skip_reason(candidate, context_for((), level="o1"))
    scripted = Candidate(module=torch.jit.script(nn.Linear(2, 2)), device=torch.device("cpu"))
    assert "TorchScript" in Inductor().skip_reason(scripted, context_for((), level="o2"))


def test_inductor_compiles_on_cpu_at_o2():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    x = torch.randn(4, 8)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    compiled = Inductor().apply(candidate, context_for((x,), level="o2"))
    assert compiled.backend == "inductor"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@cuda
def test_cuda_graph_runner_replays_per_shape_and_outputs_survive_the_next_call():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).cuda().eval()
    runner = CudaGraphRunner(model, torch.device("cuda"))
    a, b = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    out_a = runner(a)
    out_b = runner(b)
    with torch.no_grad():
        torch.testing.assert_close(out_a, model(a))
        torch.testing.assert_close(out_b, model(b))
    runner(torch.randn(6, 8, device="cuda"))
    assert len(runner.graphs) == 2


def test_packed_outputs_come_back_with_their_dtypes_shapes_and_structure():
    outputs = (
        torch.arange(6, dtype=torch.float16).view(2, 3),
        {"ids": torch.tensor([1, -2], dtype=torch.int64), "name": "kept"},
        torch.tensor([True, False, True]),
        torch.rand(5, 4),
    )
    assert _PackedOutputs.packable(outputs)
    packed = _PackedOutputs(outputs)
    first = packed.copy()
    packed.buffer.zero_()  # as the graph's next replay overwrites it
    second = packed.copy()
    assert first[1]["name"] == "kept"
    for got, want in (
        (first[0], torch.arange(6, dtype=torch.float16).view(2, 3)),
        (first[1]["ids"], torch.tensor([1, -2])),
        (first[2], torch.tensor([True, False, True])),
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert first[3].shape == (5, 4) and first[3].dtype == torch.float32
    assert not second[3].any() and not second[1]["ids"].any()


def test_outputs_are_packed_only_when_small_contiguous_and_several():
    small = torch.zeros(4)
    assert not _PackedOutputs.packable((small,))  # one output: nothing to save
    assert not _PackedOutputs.packable((small, torch.zeros(4, 4).t()))
    assert not _PackedOutputs.packable((small, torch.zeros(1 << 20)))  # 4 MiB: one copy each


@cuda
def test_cuda_graph_runner_returns_packed_outputs_that_survive_the_next_call():
    class TwoOutputs(nn.Module):
        def forward(self, x, scale=1.0):
            return {"sum": x.sum(1) * scale, "top": x.argmax(1)}

    runner = CudaGraphRunner(TwoOutputs(), torch.device("cuda"))
    a, b = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    out_a = runner(a)
    out_b = runner(b)
    assert next(iter(runner.graphs.values())).packed is not None
    torch.testing.assert_close(out_a["sum"], a.sum(1))
    assert torch.equal(out_a["top"], a.argmax(1)) and out_a["top"].dtype == torch.int64
    torch.testing.assert_close(out_b["sum"], b.sum(1))
    # Keyword arguments take the general path, a graph of their own.
    torch.testing.assert_close(runner(a, scale=2.0)["sum"], a.sum(1) * 2)
    assert len(runner.graphs) == 2
    needs_grad = a.clone().requires_grad_()
    torch.testing.assert_close(runner(needs_grad)["sum"], a.sum(1))
    statics = [s for g in runner.graphs.values() for s in g.static_inputs if s is not None]
    assert not any(s.requires_grad for s in statics)


@cuda
def test_gpu_passes_on_a_detector(retinanet, photos):
    optimized, spec, report = bladesmith.optimize(
        retinanet, device="cuda", test_data=[(photos,)], config=QUICK
    )
    records = {record.name: record for record in report.optimizations}
    assert records["cuda_graph"].status != "failed", records["cuda_graph"].reason
    assert records["inductor"].status != "failed", records["inductor"].reason
    assert report.accuracy["passed"]
    with torch.no_grad():
        expected = copy.deepcopy(retinanet).cuda()([p.cuda() for p in photos])
    assert compare_detections(expected, optimized(photos)).passed
    assert CudaGraph.name in spec.passes or records["cuda_graph"].status == "rejected"


@cuda
def test_head_packing_in_half_precision_in_a_cuda_graph_keeps_the_detections(retinanet, photos):
    from bladesmith.passes.head_packing import HeadPacking

    plain, packed = detections_through(
        retinanet,
        photos,
        (Float16(), ChannelsLast(), CudaGraph()),
        (HeadPacking(), Float16(), ChannelsLast(), CudaGraph()),
    )
    assert compare_detections(plain, packed, score_atol=1.1e-2).passed
