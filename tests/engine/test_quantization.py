"""INT8 judged by the task's metric: the metric itself (top-1 agreement, detection F1
and mAP, the user's), calibration inputs apart from the held-out ones, and the
openvino_int8 pass end to end: a small CNN kept at o2 whose saved .ov gives the same
top-1 in a new process, and a model built to break under INT8 (one activation channel
1e4 times the others) rejected with the metric in the reason."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith import images
from bladesmith.config import Config
from bladesmith.errors import SettingError
from bladesmith.images import varied_photos
from bladesmith.passes import Pass
from bladesmith.verify import precisions, task_metric
from bladesmith.verify.heldout import calibration_inputs, held_out_inputs

QUICK = dict(warmup=1, iters=2, rounds=2, min_speedup=1e-6, progress=False)


def test_top1_agreement_counts_flipped_items_against_its_bar():
    torch.manual_seed(0)
    logits = torch.randn(100, 10)
    flipped = logits.clone()
    for row in (3, 40):  # their top class becomes another
        flipped[row, logits[row].argmin()] = logits[row].max() + 1
    same = task_metric.judge([logits], [logits.clone()], [()], Config())
    assert same.passed and same.value == 1.0 and same.count == 100
    moved = task_metric.judge(
        [logits[:50], logits[50:]], [flipped[:50], flipped[50:]], [()] * 2, Config()
    )
    assert moved.value == pytest.approx(0.98) and moved.drop == pytest.approx(0.02)
    assert not moved.passed and "top-1 agreement 0.98" in moved.line and "bar 0.99" in moved.line
    assert task_metric.judge([logits], [flipped], [()], Config(max_drop=0.02)).passed
    one_class = logits.clone()
    one_class[:, 0] = 100  # every item is class 0: agreement would say nothing
    assert "one class" in task_metric.judge([one_class], [one_class], [()], Config())


def _boxes(count: int, shift: float = 0.0) -> dict:
    corners = torch.arange(count, dtype=torch.float32)[:, None] * 20 + shift
    boxes = torch.cat([corners, corners, corners + 10, corners + 10], 1)
    return {
        "boxes": boxes,
        "scores": torch.linspace(0.9, 0.5, count),
        "labels": torch.ones(count, dtype=torch.int64),
    }


def test_detection_agreement_matches_by_class_at_iou_half_with_f1_and_map():
    reference = [[_boxes(20)]]
    assert task_metric.judge(reference, [[_boxes(20, shift=1.0)]], [()], Config()).value == 1.0
    missing = _boxes(20)
    missing = {key: value[:18] for key, value in missing.items()}  # two of 20 lost
    verdict = task_metric.judge(reference, [[missing]], [()], Config())
    assert verdict.value == pytest.approx(2 * 18 / 38) and not verdict.passed
    assert "detection F1 at IoU 0.5" in verdict.line and "mAP@0.5 0.9" in verdict.line
    far = _boxes(20, shift=8.0)  # IoU (2x2)/(10x10*2-4) < 0.5: nothing matches
    assert task_metric.judge(reference, [[far]], [()], Config()).value == 0.0


def test_a_user_metric_is_compared_with_the_model_as_given_within_max_drop():
    def mean_output(outputs, inputs):
        return float(torch.cat(outputs).mean())

    config = Config(metric=mean_output, max_drop=0.1)
    reference = [torch.ones(2, 3)]
    assert task_metric.judge(reference, [torch.ones(2, 3) * 0.95], [()], config).passed
    low = task_metric.judge(reference, [torch.ones(2, 3) * 0.8], [()], config)
    assert not low.passed and "Config.metric mean_output 0.8" in low.line
    assert "no task metric fits" in task_metric.judge(
        [torch.ones(3)], [torch.ones(3)], [()], Config()
    )


def test_settings_of_quantization_are_checked():
    with pytest.raises(SettingError, match="Config.metric: expected a function"):
        Config(metric=3)
    with pytest.raises(SettingError, match="Config.calibration_data"):
        Config(calibration_data="images/")
    with pytest.raises(SettingError, match="Config.max_drop"):
        Config(max_drop=-0.1)


def test_calibration_inputs_are_never_the_held_out_or_test_inputs():
    test = [(varied_photos(4, (32, 32)),)]
    calibration = calibration_inputs(test)
    held = held_out_inputs(test)
    assert len(calibration) == 8 and calibration.args[0][0].shape == (4, 3, 32, 32)
    shown = [*test, *held.args]
    for (batch,) in calibration.args:
        for (other,) in shown:
            # No image of a calibration batch is one the verdict sees.
            assert not any(torch.allclose(a, b, atol=0.05) for a in batch for b in other)
    again = calibration_inputs(test)  # seeded: the same every run
    assert all(torch.equal(a[0], b[0]) for a, b in zip(calibration.args, again.args))


def test_int8_is_a_precision_judged_by_the_metric():
    assert precisions.INT8.by_metric and precisions.INT8.dtype is None
    assert precisions.of_dtype(torch.bfloat16) is precisions.BFLOAT16
    assert not precisions.BFLOAT16.by_metric and precisions.BFLOAT16.noise_unit == 2.0**-8


def test_a_specs_dtype_names_its_precision_int8_and_float8_included():
    """A spec says "float8", which torch has no dtype of that name for: save's reload
    check and bench's comparison read the precision, not getattr(torch, ...)."""
    assert precisions.named("float8") is precisions.FLOAT8
    assert precisions.named("int8") is precisions.INT8
    assert precisions.named("float16") is precisions.FLOAT16
    assert precisions.named("float8_e5m2").dtype is torch.float8_e5m2


def test_bench_does_not_compare_a_metric_judged_result_by_a_tolerance():
    from bladesmith.cli.optimize import _agreement

    row = {"input_shape": [1, 3, 8, 8], "dtype": "float16"}
    outputs = torch.ones(1, 4)
    assert _agreement((row, outputs), (row, outputs)).startswith("match")
    line = _agreement((row, outputs), ({**row, "dtype": "float8"}, outputs + 1))
    assert line == "not compared: a float8 result is judged by its task's metric, not a tolerance"


@functools.cache
def _trained() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    views = varied_photos(40, (48, 48), seed=11)
    labels = torch.arange(40) % len(images._VIEWED)  # view i shows photograph i
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(views), labels).backward()
        optimizer.step()
    return model.eval()


def small_cnn() -> nn.Module:
    """A small CNN trained for a few seconds to tell the photographs apart: with random
    weights every input gets one class (its biases decide), which any result agrees with,
    and a classifier of no margin flips under any change of arithmetic."""
    return copy.deepcopy(_trained())


def outlier_cnn() -> nn.Module:
    """A CNN whose first layer's channel 0 is 1e4 times the others, scaled back by the
    next layer: in float every channel counts; with one INT8 scale for the activation
    (per tensor) the small channels round to zero and the class follows channel 0."""
    model = small_cnn()  # its classes set in float, before the outlier
    first, second = model[0], model[2]
    with torch.no_grad():
        first.weight[0] *= 1e4
        first.bias[0] *= 1e4
        second.weight[:, 0] /= 1e4
    return model


def _int8(model, photos, mixed=False, **settings):
    from bladesmith.passes.openvino_int8 import OpenVinoInt8, OpenVinoInt8Mixed

    config = Config(**{**QUICK, **settings})
    passes = [OpenVinoInt8(), *([OpenVinoInt8Mixed()] if mixed else [])]
    return bladesmith.optimize(model, test_data=[photos], level="o2", config=config, passes=passes)


@pytest.fixture(scope="module")
def photos():
    return varied_photos(8, (48, 48))


@pytest.mark.slow  # trains, optimizes, saves and reloads in a new process: about a minute
def test_a_small_cnn_is_kept_in_int8_and_its_saved_file_agrees_in_a_new_process(photos, tmp_path):
    pytest.importorskip("nncf")
    from bladesmith.fresh_load import run_saved

    model = small_cnn()
    optimized, spec, report = _int8(model, photos)
    record = report.optimizations[0]
    assert record.status == "kept", record.reason
    assert spec.dtype == "int8" and spec.save_formats == (".ov",)
    assert "top-1 agreement 1 " in record.reason and "bar 0.99" in record.reason
    assert spec.tolerance["metric"] == "top-1 agreement" and spec.tolerance["drop"] == 0.0
    # The .pt and .onnx would not run the INT8 model: refused, with the precision named.
    assert spec.refused_formats[".onnx"].startswith("int8 was kept (openvino_int8)")
    notes = " ".join(report.diagnosis["notes"])
    assert "openvino_int8: calibrated on 8 derived from the test data" in notes
    path = tmp_path / "model.ov"
    bladesmith.save(optimized, path)
    other = varied_photos(9, (48, 48), seed=7)[1:]
    outputs, problem = run_saved(path, (other,))
    assert problem is None, problem
    with torch.no_grad():
        assert torch.equal(outputs.argmax(-1), model(other).argmax(-1))


def test_a_model_that_int8_breaks_is_rejected_with_the_metric_in_the_reason(photos, capfd):
    pytest.importorskip("nncf")
    model = outlier_cnn()
    optimized, spec, report = _int8(model, photos)
    assert "Statistics collection" not in capfd.readouterr().out  # NNCF's progress bars
    record = report.optimizations[0]
    assert record.status == "rejected", record.reason
    assert record.reason.startswith("openvino_int8: top-1 agreement "), record.reason
    assert "is below the bar 0.99" in record.reason, record.reason
    assert spec.dtype == "float32" and spec.backend == "eager"


def test_an_int8_result_rejected_for_speed_still_states_its_metric(photos):
    pytest.importorskip("nncf")
    _, spec, report = _int8(small_cnn(), photos, min_speedup=100.0)
    record = report.optimizations[0]
    assert record.status == "rejected" and "below the 100x needed" in record.reason, record
    assert "top-1 agreement 1 " in record.reason and "bar 0.99" in record.reason, record
    assert spec.dtype == "float32"


class _RightWhereSeen(nn.Module):
    """``inner``, with the first item of each batch given another class wherever the
    batch is none of ``seen``: wrong on one item in eight of every input but those."""

    def __init__(self, inner: nn.Module, seen: list[torch.Tensor]):
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, x):
        logits = self.inner(x)
        if any(s.shape == x.shape and torch.equal(s, x) for s in self.seen):
            return logits
        return torch.cat([logits[:1].roll(1, -1), logits[1:]])


class _SeenOnly(Pass):
    """An INT8 result right on the test data and its first held-out inputs alone."""

    name = "seen_only"
    levels = ("o2",)
    computes_in = precisions.INT8

    def apply(self, candidate, context):
        shown = [*context.test_args, *held_out_inputs(context.test_args).args]
        module = _RightWhereSeen(candidate.module, [args[0] for args in shown])
        return candidate.with_module(module, self.name, precision=precisions.INT8)


def test_a_metric_verdict_counts_over_a_hundred_items_not_the_few_a_tolerance_needs(photos):
    # The two held-out variants the tolerance checks use (16 items) would pass it.
    config = Config(**QUICK)
    _, spec, report = bladesmith.optimize(
        small_cnn(), "o2", test_data=[photos], config=config, passes=[_SeenOnly()]
    )
    [record] = report.optimizations
    assert record.status == "rejected", record.reason
    assert "top-1 agreement 0.89" in record.reason and "over 104 items" in record.reason
    assert spec.dtype == "float32"


def test_held_out_data_given_is_what_every_verdict_judges_on(photos):
    others = varied_photos(16, (48, 48), seed=5)
    config = Config(**QUICK, held_out_data=[others[:8], others[8:]])
    _, spec, report = bladesmith.optimize(
        small_cnn(), "o2", test_data=[photos], config=config, passes=[_SeenOnly()]
    )
    [record] = report.optimizations
    assert record.status == "rejected", record.reason
    assert "top-1 agreement 0.875" in record.reason and "over 16 items" in record.reason
    assert "(2 given by Config.held_out_data)" in record.reason, record.reason
    assert report.user_config["held_out_data"] == "2 entries"
    with pytest.raises(SettingError, match=r"^Config.held_out_data: entry 1 matches no"):
        bladesmith.optimize(
            small_cnn(), "o2", test_data=[photos], passes=[_SeenOnly()],
            config=Config(**QUICK, held_out_data=[others[:8], others[8:12]]),
        )  # fmt: skip


def test_a_user_metric_gates_the_int8_result(photos):
    pytest.importorskip("nncf")

    def never_enough(outputs, inputs):  # the result always loses 1 against the model
        never_enough.calls += 1
        return float(never_enough.calls % 2 == 1)

    never_enough.calls = 0
    _, spec, report = _int8(small_cnn(), photos, metric=never_enough, max_drop=0.5)
    record = report.optimizations[0]
    assert record.status == "rejected" and "Config.metric never_enough 0 " in record.reason


@pytest.mark.slow  # NNCF's accuracy control ranks the layers: about two minutes here
def test_the_layers_int8_breaks_are_kept_in_float_and_named(photos):
    pytest.importorskip("nncf")
    _, spec, report = _int8(outlier_cnn(), photos, mixed=True)
    whole, mixed = report.optimizations
    assert whole.status == "rejected" and "top-1 agreement" in whole.reason
    assert mixed.status == "kept", mixed.reason
    assert "top-1 agreement 1 " in mixed.reason and spec.dtype == "int8"
    note = next(n for n in report.diagnosis["notes"] if "kept in float" in n)
    # The outlier's layer (0) or the one it feeds (2) is named; not every layer is.
    assert "0 (Convolution)" in note or "2 (Convolution)" in note, note
    assert "4 (Convolution)" not in note, note


def test_accuracy_controls_skip_line_states_the_verdict_over_all_calibration_calls():
    """NNCF validates subsets too: the line names the last verdict over every call."""
    from bladesmith.passes.openvino_int8 import _on_all_calls

    def verdict(value, count):
        return task_metric.MetricVerdict("top-1 agreement", value, 1.0, 0.99, count)

    line = _on_all_calls([verdict(1.0, 64), "not judged", verdict(0.995, 64), verdict(0.5, 2)])
    assert "0.995" in line and "over 64 items" in line, line
    assert _on_all_calls(["not judged"]) == ""
