"""A detector whose own detections rounding alone moves past the gate (a two-stage
detector with random weights: proposals flip, and the second stage follows them) is
judged at that floor: a change of arithmetic as small as TF32's is kept, a wrong pass is
still rejected, and the report says so."""

from __future__ import annotations

import copy

import pytest
import torch

import bladesmith
from bladesmith.families.rcnn import build_rcnn
from bladesmith.images import sample_images
from bladesmith.passes import Candidate, Pass
from bladesmith.passes.fixed_shape import FixedShape

SIZE = (160, 224)
SMALL = dict(num_classes=5, rpn_pre_nms_top_n_test=300, rpn_post_nms_top_n_test=200)
# Accuracy decides here: a 2-core machine shared with other work times too noisily.
QUICK = bladesmith.Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)


class OtherArithmetic(Pass):
    """Every convolution and linear layer's outputs moved by 2^-11 of themselves, as
    another kernel in TF32 moves them on a GPU (seeded: the same each call)."""

    name = "other_arithmetic"

    def apply(self, candidate: Candidate, context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        generator = torch.Generator().manual_seed(0)

        def jitter(layer, inputs, output):
            draw = torch.randn(output.shape, generator=generator)
            return output * (1 + 2.0**-11 * draw)

        for layer in module.modules():
            if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
                layer.register_forward_hook(jitter)
        return candidate.with_module(module, self.name)


class FirstConvHalfOff(Pass):
    """A wrong pass: the backbone's first convolution's weights 1.5 times."""

    name = "first_conv_half_off"

    def apply(self, candidate: Candidate, context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        first = next(m for m in module.backbone.modules() if isinstance(m, torch.nn.Conv2d))
        with torch.no_grad():
            first.weight.mul_(1.5)
        return candidate.with_module(module, self.name)


@pytest.fixture(scope="module")
def report():
    model = build_rcnn("fasterrcnn_mobilenet_v3_large_fpn", SIZE, **SMALL)
    images = list(sample_images(2, SIZE))
    passes = [FixedShape(), OtherArithmetic(), FirstConvHalfOff()]
    return bladesmith.optimize(
        model, "o1", device="cpu", test_data=[(images,)], config=QUICK, passes=passes
    )[2]


@pytest.mark.slow
def test_a_change_of_arithmetic_is_kept_at_the_models_own_noise_floor(report):
    records = {record.name: record for record in report.optimizations}
    other = records["other_arithmetic"]
    assert other.accuracy["passed"] and "within tolerance" in other.reason, other.reason
    notes = report.diagnosis["notes"]
    assert len([note for note in notes if "judged at that floor" in note]) == 1, notes
    assert "judged at that floor" in report.diagnosis["message"]


@pytest.mark.slow
def test_a_wrong_pass_is_still_rejected_at_the_floor(report):
    wrong = {record.name: record for record in report.optimizations}["first_conv_half_off"]
    assert wrong.status == "rejected" and "moved past tolerance" in wrong.reason, wrong.reason


class Pointer(torch.nn.Module):
    """Four detections whose keypoints move with their weights' last bits (``gain``
    times each weight: as a random-weight heatmap's argmax does) and whose boxes and
    scores do not."""

    def __init__(self, gain: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.gain = gain

    def forward(self, images):
        wobble = 20 * torch.sin(self.weight * self.gain)
        points = torch.stack([50 + wobble, 50 - wobble, torch.ones(4)], -1)[:, None]
        boxes = torch.tensor([[0.0, 0.0, 100.0, 100.0]]) + 200 * torch.arange(4.0)[:, None]
        scores, labels = torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.ones(4, dtype=torch.int64)
        return [{"boxes": boxes, "scores": scores, "labels": labels, "keypoints": points}]


@pytest.mark.parametrize("gain, floor", [(1.0, False), (1e5, True)], ids=["steady", "chaotic"])
def test_keypoints_are_judged_at_the_models_own_noise_floor(gain, floor):
    """Masks and keypoints go through the floor as scores do: where rounding alone moves
    the model's keypoints past their tolerance (5.3% of the box), a candidate may move
    them as far (here about 19%), and no further."""
    from bladesmith.engine.reference import Reference
    from bladesmith.passes.registry import Context

    model, args = Pointer(gain), (torch.zeros(1),)
    config = bladesmith.Config()
    context = Context(torch.device("cpu"), "o1", config, args, [args])
    with torch.no_grad():
        reference = Reference([model(*args)], Candidate(model, torch.device("cpu")), context)

        def moved(shift: float):
            outputs = model(*args)
            outputs[0]["keypoints"] = outputs[0]["keypoints"] + torch.tensor([shift, 0.0, 0.0])
            return reference.compare([outputs], torch.float32, config)

        assert moved(3.0).passed  # within 5.3% of the box: no floor needed
        assert moved(8.0).passed == floor
        far = moved(30.0)
    assert not far.passed and "matched keypoints moved past tolerance" in far.summary()
    notes = [note for note in context.notes if "judged at that floor" in note]
    assert len(notes) == floor and all("keypoints as far" in note for note in notes)
