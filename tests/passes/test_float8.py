"""fp8: Linear layers in float8 e4m3. The layer's arithmetic runs on this CPU too
(torch._scaled_mm has a CPU kernel); the pass and its verdicts need an FP8 GPU."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.float8 import (
    E4M3,
    Float8,
    Float8Linear,
    Float8Static,
    convertible,
    input_amax,
    layers_to_keep,
    to_float8,
)
from bladesmith.passes.inductor import Inductor
from bladesmith.passes.projected_attention import ProjectedAttention
from bladesmith.passes.registry import Context, PassSkipped
from engine_testing import Wasteful, cuda
from test_reload import reload_in_new_process


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def test_a_float8_linear_computes_the_linear_within_e4m3_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    fp8 = Float8Linear(linear)
    assert fp8.weight.dtype == E4M3 and fp8.weight.shape == (48, 64)
    for x in (torch.randn(5, 7, 64), torch.randn(3, 64) * 100):
        error = _relative_error(fp8(x), linear(x).detach())
        # e4m3 keeps 3 mantissa bits (steps of 1/16 relative): a few percent, never exact
        assert 1e-3 < error < 0.08, error


def test_a_float8_linear_answers_in_its_input_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16).half()
    x = torch.randn(4, 32, dtype=torch.float16)
    got = Float8Linear(linear)(x)
    assert got.dtype == torch.float16
    assert _relative_error(got, linear.float()(x.float())) < 0.08


def test_one_outlier_channel_drowns_the_others_in_a_per_tensor_scale():
    """Why fp8 is judged by the task's metric: a scale set by one huge channel flushes
    the small values of the rest to zero."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 16, bias=False)
    x = torch.randn(8, 64) * 0.01
    x[:, 0] = 1e5
    with torch.no_grad():
        linear.weight[:, 0] = 0  # the outlier channel adds nothing to the answer
    assert _relative_error(Float8Linear(linear)(x), linear(x).detach()) > 0.5


def test_a_static_float8_linear_scales_by_its_calibrated_range_and_saturates_past_it():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    calibration = torch.randn(32, 64)
    amax = input_amax(linear, [""], [(calibration,)])[""]
    assert amax == calibration.abs().max()
    static = Float8Linear(linear, amax)
    assert static.input_scale == amax / torch.finfo(E4M3).max
    x = torch.randn(5, 64)
    assert 1e-3 < _relative_error(static(x), linear(x).detach()) < 0.08
    # Past the calibrated range the input saturates, where a dynamic scale would follow it.
    big = x * 100
    with torch.no_grad():
        assert _relative_error(static(big), linear(big)) > 0.5
        assert _relative_error(Float8Linear(linear)(big), linear(big)) < 0.08
        saturated = big.clamp(-amax, amax)
        torch.testing.assert_close(static(big), static(saturated))


def test_fp8_static_calibrates_on_the_calibration_inputs_and_compiles():
    cpu = torch.device("cpu")
    model = Clusters(width=64).eval()
    x = model.inputs(32, seed=0)
    calibration = [(model.inputs(16, seed=seed),) for seed in (5, 6)]
    context = Context(
        device=cpu,
        level="o2",
        config=Config(),
        example_args=(x,),
        calibration=lambda: (calibration, "2 calibration batches"),
    )
    result = Float8Static().apply(Candidate(model, cpu), context)
    assert result.module_passes == ("fp8_static",) and result.runner_passes == ("inductor",)
    layers = [each for each in result.module.modules() if isinstance(each, Float8Linear)]
    assert len(layers) == 3 and all(each.input_scale is not None for each in layers)
    seen = max(float(each[0].abs().max()) for each in calibration)
    assert float(layers[0].input_scale) == pytest.approx(seen / torch.finfo(E4M3).max)
    assert (
        "3 Linear layer(s) in float8 e4m3 with their input's scale calibrated on 2 "
        in (context.notes[-1])
    )
    with torch.no_grad():
        assert 1e-4 < _relative_error(result(x), model(x)) < 0.08
    kept = Context(device=cpu, level="o2", config=Config(), example_args=(x,), kept=["fp8"])
    assert Float8Static().skip_reason(Candidate(model, cpu), kept) == "fp8 was kept"


def test_fp8_takes_linears_with_sizes_multiples_of_16_and_the_attentions_projections():
    """torchvision's ViT: its MLPs' Linears and its attention's projections (once
    nn.MultiheadAttention, which reads their weights itself, is projected), not a head of
    10 classes."""
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=16,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=10,
    ).eval()
    nn.init.normal_(vit.heads.head.weight)  # torchvision starts it at zero
    names = convertible(vit)
    layers = [f"encoder.layers.encoder_layer_{i}" for i in (0, 1)]
    mlps = [f"{layer}.mlp.{j}" for layer in layers for j in (0, 3)]
    projections = [f"{layer}.self_attention.{j}_proj" for layer in layers for j in ("in", "out")]
    assert names == mlps + projections
    converted = to_float8(vit, names)
    assert isinstance(converted.encoder.layers[0].mlp[0], Float8Linear)
    attention = converted.encoder.layers[1].self_attention
    assert isinstance(attention, ProjectedAttention)
    assert isinstance(attention.in_proj, Float8Linear) and attention.in_proj.out_features == 192
    assert isinstance(vit.encoder.layers[0].mlp[0], nn.Linear)  # the input untouched
    assert isinstance(vit.encoder.layers[0].self_attention, nn.MultiheadAttention)
    x = torch.rand(4, 3, 32, 32)
    assert set(input_amax(vit, names, [(x,)])) == set(names)  # every one reached
    with torch.no_grad():
        assert 1e-4 < _relative_error(converted(x), vit(x)) < 0.1


def test_fp8_is_skipped_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    model = nn.Sequential(nn.Linear(32, 32))
    context = Context(device=torch.device("cuda"), level="o2", config=Config(), example_args=())
    reason = Float8().skip_reason(Candidate(model, torch.device("cuda")), context)
    assert reason is not None and "8.0" in reason and "8.9" in reason, reason


class Clusters(nn.Module):
    """A classifier whose classes are far apart: class c's score is the input's product
    with centre c, after hidden layers that keep it (wide enough for FP8 to pay). With
    ``outlier``, the first layer's weight holds one entry a million times the rest (on a
    channel these inputs leave at zero): in FP8 its scale flushes the others to zero."""

    def __init__(self, width: int = 4096, classes: int = 16, outlier: bool = False):
        super().__init__()
        half = torch.randn(classes, width // 2, generator=torch.Generator().manual_seed(0))
        half[:, 0] = 0  # the outlier's channel: zero in the inputs this class gives
        # symmetric, so that a held-out input (an input reversed and moved) keeps its class
        self.centres = torch.cat([half, half.flip(-1)], dim=-1)
        self.hidden = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
        with torch.no_grad():
            for layer in self.hidden:
                layer.weight.copy_(torch.eye(width))
                layer.bias.zero_()
            if outlier:
                self.hidden[0].weight[0, 0] = 1e6
        self.head = nn.Linear(width, classes, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(self.centres)
            self.head.weight[:, 0] = 0

    def inputs(self, count: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, len(self.centres), (count,), generator=generator)
        x = self.centres[labels] + 0.3 * torch.randn(
            count, self.centres.shape[1], generator=generator
        )
        x[:, 0] = 0
        return x

    def forward(self, x):
        return self.head(self.hidden(x))


def test_fp8_mixed_keeps_the_layer_fp8_breaks_and_no_other():
    model = Clusters(width=64, outlier=True).eval()
    names = convertible(model)
    assert names == ["hidden.0", "hidden.1", "head"]
    calls = [(model.inputs(128, seed),) for seed in range(2)]
    assert layers_to_keep(model, names, calls, Config()) == ["hidden.0"]


def test_fp8_mixed_has_nothing_to_keep_where_every_layer_holds():
    model = Clusters(width=64).eval()
    calls = [(model.inputs(128, seed),) for seed in range(2)]
    with pytest.raises(PassSkipped, match="every Linear layer holds"):
        layers_to_keep(model, convertible(model), calls, Config())


@pytest.mark.slow
def test_fp8s_result_is_compiled_by_inductor_and_saves_as_ptc(tmp_path):
    """On this CPU, the pass's apply alone (the pass runs on FP8 GPUs): the FP8 module
    compiled by Inductor, then that module saved as .ptc, float8 weights and all."""
    cpu = torch.device("cpu")
    model = Clusters(width=64).eval()
    x = model.inputs(32, seed=0)
    context = Context(device=cpu, level="o1", config=Config(), example_args=(x,))
    result = Float8().apply(Candidate(model, cpu), context)
    assert result.module_passes == ("fp8",) and result.runner_passes == ("inductor",)
    assert result.computes_in.name == "float8"
    with torch.no_grad():
        assert _relative_error(result(x), result.module(x)) < 1e-2
        assert 1e-4 < _relative_error(result(x), model(x)) < 0.08
    # Inductor kept whatever its gain (Wasteful: dead code it drops)
    config = Config(save_as=".ptc", progress=False)
    optimized, spec, _ = bladesmith.optimize(
        Wasteful(result.module),
        "o2",
        device="cpu",
        test_data=[(x,)],
        passes=[Inductor()],
        config=config,
    )
    assert spec.save_formats[0] == ".ptc", spec.refused_formats
    path = bladesmith.save(optimized, tmp_path / "fp8.ptc")
    with torch.no_grad():
        expected = optimized(x)
    reload_in_new_process(path, (x,), expected, tmp_path)


class _Float8OnThisCpu(Float8):
    """fp8 where this CPU runs it (torch._scaled_mm has a CPU kernel): the pass itself
    runs only on FP8 GPUs."""

    devices = ("cpu",)

    def skip_reason(self, candidate, context):
        return None


@pytest.mark.slow
def test_a_kept_fp8_result_is_refused_pt_and_onnx_and_saves_as_ptc(tmp_path):
    """Its spec says float8: .pt and .onnx refused for it before any try, the .ptc saved,
    reloaded in a new process. (Wasteful: the dead product its compile drops makes it
    win over eager; Inductor alone is excluded, so that fp8 is the pass that compiles.)"""
    model = Clusters(width=64).eval()
    data = [(model.inputs(64, seed),) for seed in range(2)]
    config = Config(include=["fp8"], exclude=["inductor"], progress=False, warmup=1, iters=3)
    optimized, spec, _ = bladesmith.optimize(
        Wasteful(model),
        "o2",
        device="cpu",
        test_data=data,
        passes=[Inductor(), _Float8OnThisCpu()],
        config=config,
    )
    assert spec.dtype == "float8" and spec.save_formats == (".ptc",), spec
    assert "float8 was kept (fp8)" in spec.refused_formats[".pt"]
    assert "float8 was kept (fp8)" in spec.refused_formats[".onnx"]
    path = bladesmith.save(optimized, tmp_path / "fp8.ptc")
    x = data[0][0]
    with torch.no_grad():
        expected = optimized(x)
    reload_in_new_process(path, (x,), expected, tmp_path)


def fp8_gpu(test):
    """A `cuda` test, skipped on a GPU without FP8 tensor cores."""
    old_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9)
    return cuda(pytest.mark.skipif(old_gpu, reason="needs FP8 tensor cores (8.9+)")(test))


def optimized_with_fp8(model: Clusters, **settings):
    """(optimized, spec, fp8's record, test data) of ``model`` on the GPU, fp8 included."""
    data = [(model.inputs(1024, seed),) for seed in range(3)]
    config = Config(include=["fp8"], progress=False, **settings)
    optimized, spec, report = bladesmith.optimize(
        model, device="cuda", test_data=data, config=config
    )
    record = next(each for each in report.optimizations if each.name == "fp8")
    return optimized, spec, record, data


@fp8_gpu
def test_on_an_fp8_gpu_fp8_is_judged_by_top1_agreement_and_saves_as_ptc(tmp_path):
    optimized, spec, record, data = optimized_with_fp8(Clusters(), save_as=".ptc")
    # judged by its metric before it is timed: rejected, if at all, for its speed alone
    assert record.status == "kept" or "needed to keep it" in record.reason, record
    if record.status == "kept":
        assert "judged by the task's metric" in record.reason, record
        assert spec.dtype == "float8" and spec.save_formats[0] == ".ptc", spec
        path = bladesmith.save(optimized, tmp_path / "fp8.ptc")
        x = data[0][0].cuda()
        with torch.no_grad():
            expected = optimized(x)
        reload_in_new_process(path, (x,), expected, tmp_path)


@fp8_gpu
def test_on_an_fp8_gpu_a_model_fp8_breaks_is_rejected_with_its_metric():
    _, spec, record, _ = optimized_with_fp8(Clusters(outlier=True))
    assert record.status == "rejected" and "top-1 agreement" in record.reason, record
    assert "fp8" not in spec.passes
