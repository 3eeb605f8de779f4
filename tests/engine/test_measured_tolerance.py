"""Float32 passes are judged at a tolerance measured on the model (its outputs under
float32 rounding noise), not a fixed 1e-5: ResNet-50's norm folding is kept, a wrong
pass is still rejected, and Config(rtol=, atol=) still overrides. Half precision is
measured the same way, in its own rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from torchvision.models import resnet50

import bladesmith
from bladesmith.passes import Candidate, Pass
from bladesmith.passes.norm_folding import NormFolding
from bladesmith.passes.precision import BFloat16, Float16
from bladesmith.verify import compare_outputs, default_tolerance

# Accuracy decides here: a 2-core machine shared with other work times too noisily.
QUICK = bladesmith.Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)


def one_conv_scaled(module, factor: float):
    """A copy of ResNet-50 ``module`` with one convolution's weights ``factor`` times."""
    module = copy.deepcopy(module)
    with torch.no_grad():
        module.layer3[2].conv2.weight.mul_(factor)
    return module


class OneConvOnePercentOff(Pass):
    """A wrong pass: one convolution's weights 1% larger (a bug a fold could have)."""

    name = "one_conv_one_percent_off"

    def apply(self, candidate: Candidate, context) -> Candidate:
        return candidate.with_module(one_conv_scaled(candidate.module, 1.01), self.name)


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return resnet50(weights=None).eval(), torch.randn(1, 3, 64, 64)


def records(report) -> dict:
    return {record.name: record for record in report.optimizations}


@pytest.mark.slow
def test_resnet50_keeps_norm_folding_and_rejects_a_one_percent_weight_error(resnet):
    model, x = resnet
    passes = [NormFolding(), OneConvOnePercentOff()]
    optimized, spec, report = bladesmith.optimize(
        model, "o1", device="cpu", test_data=[x], config=QUICK, passes=passes
    )
    by_name = records(report)
    folding = by_name["norm_folding"]  # judged by accuracy: timing may still drop it
    assert folding.accuracy["passed"] and "within tolerance" in folding.reason, folding.reason
    wrong = by_name["one_conv_one_percent_off"]
    assert wrong.status == "rejected" and "moved past tolerance" in wrong.reason
    # By far: the wrong pass moves the logits hundreds of times past what was allowed.
    assert wrong.accuracy["tolerance_ratio"] > 50
    tolerance = report.tolerance
    assert "rounding" in tolerance["why"]
    assert 1e-5 < tolerance["atol"] < 1e-2
    assert spec.tolerance["atol"] == tolerance["atol"]
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(optimized(x), expected, rtol=1e-4, atol=tolerance["atol"])


def test_config_tolerances_override_the_measured_one(resnet):
    model, x = resnet
    config = QUICK.replace(rtol=0.0, atol=0.0)
    _, _, report = bladesmith.optimize(
        model, "o1", device="cpu", test_data=[x], config=config, passes=[NormFolding()]
    )
    assert records(report)["norm_folding"].status == "rejected"  # folding rounds weights
    assert report.tolerance == {"rtol": 0.0, "atol": 0.0, "why": "Config(rtol=0, atol=0)"}


class CpuBFloat16(BFloat16):
    """The bf16 pass on the CPU whether or not it computes in bfloat16 natively (where
    not, oneDNN emulates it): what is tested is how it is judged."""

    def skip_reason(self, candidate: Candidate, context) -> str | None:
        return Float16.skip_reason(self, candidate, context)


class BFloat16OneConvHalfOff(CpuBFloat16):
    """A wrong half-precision pass: bf16, and one convolution's weights 1.5 times."""

    name = "bf16_one_conv_half_off"

    def apply(self, candidate: Candidate, context) -> Candidate:
        broken = candidate.with_module(one_conv_scaled(candidate.module, 1.5), "broken")
        return super().apply(broken, context)


@pytest.mark.slow
def test_half_precision_is_judged_at_a_tolerance_measured_in_its_own_rounding(resnet):
    """ResNet-50 in bfloat16 moves its logits about 0.3, past the fixed bfloat16
    tolerance (1e-2 + 5e-2 x |logit|) near zero logits, yet less than rounding its
    weights to bfloat16 moves them: it is kept, a broken bf16 pass is not."""
    model, x = resnet
    with torch.no_grad():
        in_bf16 = copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    rtol, atol = default_tolerance(torch.bfloat16)
    assert not compare_outputs(model(x), in_bf16, rtol=rtol, atol=atol).passed
    _, _, report = bladesmith.optimize(
        model, "o1", device="cpu", test_data=[x], config=QUICK, passes=[CpuBFloat16()]
    )
    record = records(report)["bf16"]  # judged by accuracy: timing may still drop it
    assert record.accuracy["passed"] and "within tolerance" in record.reason, record.reason
    _, _, broken = bladesmith.optimize(
        model, "o1", device="cpu", test_data=[x], config=QUICK, passes=[BFloat16OneConvHalfOff()]
    )
    wrong = records(broken)["bf16_one_conv_half_off"]
    assert wrong.status == "rejected" and "moved past tolerance" in wrong.reason
