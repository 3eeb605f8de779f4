"""Results are verified on inputs the passes never saw: a result that answers every input
with the test data's answer is refused, whichever pass made it, and a TorchScript model
called on a list of dicts (PAI-Blade's detector form) is never traced into constants."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import bladesmith
from bladesmith.config import Config
from bladesmith.images import sample_images
from bladesmith.passes import Pass
from bladesmith.passes.precision import BFloat16
from bladesmith.passes.torchscript import TorchScriptFreeze
from bladesmith.verify.heldout import held_out_inputs
from engine_testing import Memoized, conv_net

QUICK = Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)


class DictDetector(nn.Module):
    """A tiny detector called as PAI-Blade's tutorial calls one: a list of {"image": ...}
    dicts in, (boxes, scores, labels) of the first image out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=4, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.classes = nn.Conv2d(16, 3, 1)
        self.corners = nn.Conv2d(16, 4, 1)
        with torch.no_grad():  # weights large enough that each image gets its own answer
            for layer in self.modules():
                if isinstance(layer, nn.Conv2d):
                    layer.weight.normal_(0, 0.3)

    def forward(self, inputs: list[dict[str, torch.Tensor]]):
        features = self.body(torch.stack([each["image"] for each in inputs]))
        scores, labels = self.classes(features).flatten(2).sigmoid().max(1)
        boxes = self.corners(features).flatten(2).transpose(1, 2).sigmoid() * 64.0
        return boxes[0], scores[0], labels[0]


class AnyCpuBFloat16(BFloat16):
    """bf16 on any CPU (emulated where it has no bfloat16 arithmetic: slower, as exact)."""

    def skip_reason(self, candidate, context):
        return None


@pytest.fixture(scope="module")
def dict_detector():
    with pytest.warns(FutureWarning):
        scripted = torch.jit.script(DictDetector().eval())
    return scripted, sample_images(2, (64, 96))


def test_a_torchscript_detector_on_a_list_of_dicts_answers_other_images(dict_detector):
    # Before, bf16's cast around the TorchScript model was traced by the torchscript
    # pass: the list of dicts went in as a constant, the graph held the test image's
    # detections, and every image got them ("3559x, within tolerance").
    model, (image, other) = dict_detector
    optimized, spec, report = bladesmith.optimize(
        model,
        "o1",
        device="cpu",
        test_data=[([{"image": image}],)],
        config=QUICK,
        passes=[AnyCpuBFloat16(), TorchScriptFreeze()],
    )
    with torch.no_grad():
        expected = model([{"image": other}])
    answered = optimized([{"image": other}])
    boxes, scores, labels = answered
    assert torch.equal(labels, expected[2])
    torch.testing.assert_close(scores, expected[1], rtol=0.05, atol=0.02)
    torch.testing.assert_close(boxes, expected[0], rtol=0.02, atol=1.0)
    assert "held_out" in report.accuracy


def test_a_saved_trace_that_holds_the_input_as_a_constant_is_refused(dict_detector):
    # The result's module is bf16's cast around the TorchScript model (memoized keeps it
    # whatever the timing), which .pt traces; the trace held the list of dicts as a
    # constant: refused, never saved (before, saved and "within tolerance").
    model, (image, _) = dict_detector
    _, spec, _ = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[([{"image": image}],)],
        config=QUICK,
        passes=[AnyCpuBFloat16(), Memoized()],
    )
    assert spec.passes == ("bf16", "memoized")
    assert ".pt" not in spec.save_formats
    assert "as constants" in spec.refused_formats[".pt"]


class Replay(Pass):
    """Answers every call with the example's outputs: right on the test data, wrong on
    any other input (what a trace that held its input as a constant does)."""

    name = "replay"

    def apply(self, candidate, context):
        with torch.no_grad():
            outputs = candidate(*candidate.runner_args(context.example_args))
        return candidate.with_runner(
            lambda *args: pytree.tree_map(torch.clone, outputs), self.name, wraps=True
        )


def test_a_pass_whose_outputs_ignore_its_inputs_is_rejected_naming_it():
    model, x = conv_net(), torch.rand(1, 3, 32, 32)
    optimized, spec, report = bladesmith.optimize(
        model, device="cpu", test_data=[x], config=QUICK, passes=[Replay()]
    )
    (record,) = report.optimizations
    assert record.status == "rejected", record.reason
    assert record.reason.startswith("replay: its outputs do not depend on its inputs")
    assert "\n" not in record.reason
    assert spec.passes == ()
    other = torch.rand(1, 3, 32, 32)
    torch.testing.assert_close(optimized(other), model(other))


class Slow(nn.Module):
    """A conv net that takes 20 ms a call: a cached answer is far more than 20x faster."""

    def __init__(self):
        super().__init__()
        self.net = conv_net()

    def forward(self, x):
        time.sleep(0.02)
        return self.net(x)


def test_an_implausible_speedup_is_kept_only_once_the_held_out_check_passes():
    x = torch.rand(1, 3, 32, 32)
    _, spec, report = bladesmith.optimize(
        Slow().eval(), device="cpu", test_data=[x], config=QUICK, passes=[Memoized()]
    )
    (record,) = report.optimizations
    assert record.status == "kept", record.reason
    assert "held-out inputs within tolerance" in record.reason
    assert "implausible: kept only as the held-out check passed" in record.reason
    assert report.accuracy["held_out"].startswith("held-out inputs within tolerance")

    _, _, report = bladesmith.optimize(
        Slow().eval(), device="cpu", test_data=[x], config=QUICK, passes=[Replay()]
    )
    (record,) = report.optimizations
    assert record.status == "rejected" and "do not depend on its inputs" in record.reason


def test_held_out_inputs_keep_the_signature_and_change_the_values():
    image = sample_images(1, (48, 64))[0]
    ids, mask = torch.tensor([[5, 9, 100, 3]]), torch.tensor([[1, 1, 1, 0]])
    entry = ([{"image": image}], ids, mask, torch.randn(2, 4), 3)
    held = held_out_inputs([entry, entry])  # one signature: variants of the first only
    assert len(held) == 2 and held.sources == [0, 0]
    for args in held.args:
        assert pytree.tree_structure(args) == pytree.tree_structure(entry)
        (changed,), other_ids, same_mask, moved, three = args
        assert changed["image"].shape == image.shape and changed["image"].dtype == image.dtype
        assert 0 <= changed["image"].min() and changed["image"].max() <= 1
        assert (changed["image"] - image).abs().mean() > 0.05
        assert not torch.equal(other_ids, ids) and 3 <= other_ids.min() <= other_ids.max() <= 100
        assert torch.equal(same_mask, mask) and three == 3
        assert not torch.equal(moved, entry[3])
    assert held_out_inputs([entry]).args[0][1].tolist() == held.args[0][1].tolist()  # seeded


def test_a_torchscript_model_on_a_list_of_dicts_says_why_it_is_not_saved_as_onnx(dict_detector):
    # Before, both said "ValueError: Invalid tensor data type 0." (the export's graph
    # input had no type), or, where torch's error began on a new line, nothing at all.
    pytest.importorskip("onnxruntime")
    from bladesmith.passes.onnxruntime import OnnxRuntime

    model, (image, _) = dict_detector
    _, spec, report = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[([{"image": image}],)],
        config=QUICK,
        passes=[OnnxRuntime()],
    )
    cause = "the scripted forward's argument inputs: List[Dict[str, Tensor]] is not a tensor"
    (record,) = report.optimizations
    assert record.status == "failed" and cause in record.reason, record.reason
    assert cause in spec.refused_formats[".onnx"], spec.refused_formats
