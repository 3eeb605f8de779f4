"""A model that cannot reproduce its own answer on the test inputs verifies nothing there:
rounding alone changes most of its detections, so a gate set by that noise would admit a
wrong result as well as a right one. The report's headline says "not verified on these
inputs" with the model's self-agreement, passes that change the arithmetic are not kept
unless Config(allow_unverified=True) (then kept and labelled), a pass that runs the same
arithmetic is kept, and a model that reproduces itself stays verified."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import bladesmith
from bladesmith.engine.reference import MIN_SELF_AGREEMENT, ROUNDING_NOISE
from bladesmith.passes import Candidate, Pass

CANDIDATES, KEPT = 100, 10
QUICK = dict(warmup=0, iters=3, rounds=3, min_speedup=1e-6, progress=False)


class NearTies(torch.nn.Module):
    """A toy detector: the ``KEPT`` best of ``CANDIDATES`` boxes far apart. Each score is
    a sine of its weight times ``gain``: with a gain of 1e5, moving a weight by 2^-11 of
    itself (rounding noise, as the reference's noise runs move them) turns its sine
    anywhere, so which boxes make the top is rounding's choice; with a gain of 1 the
    scores stay apart and the same boxes win. ``delay`` seconds of each call stand for
    work a pass can remove (timed without a CPU that others share)."""

    def __init__(self, gain: float, delay: float = 4e-3):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(1.0, 2.0, CANDIDATES))
        self.gain, self.delay = gain, delay
        corner = 30.0 * torch.arange(CANDIDATES, dtype=torch.float32)
        self.register_buffer("boxes", torch.stack([corner, corner, corner + 20, corner + 20], 1))

    def forward(self, images):
        time.sleep(self.delay)
        level = torch.stack([image.mean() for image in images]).mean()
        raw = torch.sin(self.weight * self.gain + 7.0 * torch.arange(CANDIDATES) + level)
        scores, index = (0.5 + 0.5 * raw).topk(KEPT)
        labels = torch.ones(KEPT, dtype=torch.int64)
        return [{"boxes": self.boxes[index], "scores": scores, "labels": labels}]


class RoundingLike(Pass):
    """Changes the arithmetic by what rounding does (each weight moved by 2^-11 of itself,
    as the reference's first noise run moves it) and halves the call's wasted time."""

    name = "rounding_like"

    def apply(self, candidate: Candidate, context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            draw = torch.randn(module.weight.shape, generator=generator)
            module.weight.mul_(1 + ROUNDING_NOISE * draw)
        module.delay /= 2
        return candidate.with_module(module, self.name)


class SameKernels(RoundingLike):
    """The same change, declared as running the same arithmetic (as a CUDA graph replays
    the kernels it captured): the engine asks the flag, not the name."""

    name = "same_kernels"
    changes_arithmetic = False


class PrecisionLike(RoundingLike):
    """The same change, declared as a precision pass (what PAI-Blade's
    disable_fp16_accuracy_check speaks of)."""

    name = "precision_like"
    changes_precision = True


def _optimize(gain: float, passes: list[Pass], **settings):
    images = [torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))]
    return bladesmith.optimize(
        NearTies(gain),
        "o1",
        device="cpu",
        test_data=[(images,)],
        config=bladesmith.Config(**QUICK, **settings),
        passes=passes,
    )


@pytest.fixture(scope="module")
def refused():
    return _optimize(1e5, [RoundingLike(), SameKernels()])


def test_a_model_that_does_not_reproduce_itself_is_not_verified(refused):
    _, _, report = refused
    headline = report.diagnosis["message"].splitlines()[0]
    assert headline.startswith("NOT VERIFIED on these inputs"), headline
    assert "agrees with itself at F1" in headline and "photographs" in headline
    agreement = report.accuracy["self_agreement"]
    assert agreement is not None and agreement < MIN_SELF_AGREEMENT
    assert f"F1 {agreement:.3g}" in headline
    assert report.accuracy["verified"] is False and report.diagnosis["verified"] is False
    assert report.to_dict()["overall"]["accuracy"]["not_verified"]


def test_a_pass_that_changes_the_arithmetic_is_refused_there(refused):
    _, spec, report = refused
    records = {record.name: record for record in report.optimizations}
    arithmetic = records["rounding_like"]
    assert arithmetic.status == "rejected", arithmetic
    assert "allow_unverified=True" in arithmetic.reason, arithmetic.reason
    assert arithmetic.accuracy["passed"] and arithmetic.accuracy["unverified"]
    assert "rounding_like" not in spec.passes
    # The flag, not the name: the same change declared as the same arithmetic is kept.
    assert records["same_kernels"].status == "kept", records["same_kernels"]
    assert "no pass that changes the arithmetic was kept" in report.diagnosis["message"]


def test_allow_unverified_keeps_it_labelled():
    _, spec, report = _optimize(1e5, [RoundingLike()], allow_unverified=True)
    [record] = report.optimizations
    assert record.status == "kept" and "not verified on these inputs" in record.reason, record
    assert spec.passes == ("rounding_like",)
    headline = report.diagnosis["message"].splitlines()[0]
    assert headline.startswith("NOT VERIFIED on these inputs"), headline
    assert "rounding_like kept unverified" in headline
    assert report.accuracy["verified"] is False


def test_pai_blades_waiver_keeps_a_precision_pass_labelled():
    _, _, report = _optimize(1e5, [PrecisionLike()], disable_fp16_accuracy_check=True)
    [record] = report.optimizations
    assert record.status == "kept", record
    assert "not verified on these inputs" in record.reason
    assert "disable_fp16_accuracy_check=True" in record.reason
    assert report.diagnosis["message"].startswith("NOT VERIFIED on these inputs")


def test_a_model_that_reproduces_itself_stays_verified():
    _, spec, report = _optimize(1.0, [RoundingLike()])
    [record] = report.optimizations
    assert record.status == "kept", record
    assert "not verified" not in record.reason and not record.accuracy["unverified"]
    assert report.accuracy["verified"] is True and not report.accuracy["not_verified"]
    assert "NOT VERIFIED" not in report.diagnosis["message"]
    assert spec.passes == ("rounding_like",)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mask_rcnn_on_uniform_noise_is_not_verified_on_the_gpu():
    """The case found on an H100: Mask R-CNN with random weights keeps near-tied
    detections down to a score of 0.005 on an image of uniform noise, and TF32 rounding
    alone reshuffles them (F1 0.02 against itself): nothing can be verified there."""
    from torchvision.models import detection

    torch.manual_seed(0)
    model = detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.005
    ).eval()
    image = torch.rand(3, 480, 640, generator=torch.Generator().manual_seed(0))
    _, spec, report = bladesmith.optimize(
        model, "o1", device="cuda", test_data=[([image],)], config=bladesmith.Config(progress=False)
    )
    headline = report.diagnosis["message"].splitlines()[0]
    assert headline.startswith("NOT VERIFIED on these inputs"), report.diagnosis["message"]
    assert report.accuracy["self_agreement"] < MIN_SELF_AGREEMENT
    assert report.accuracy["verified"] is False
    refused = [r for r in report.optimizations if "allow_unverified=True" in r.reason]
    kept = [r.name for r in report.optimizations if r.status == "kept"]
    assert not set(kept) & {"inductor", "fp16", "bf16", "channels_last"}, kept
    print(headline, [(r.name, r.status) for r in refused], kept, spec.passes)
