"""save()/load(): TorchScript and AOTInductor artifacts give the optimized module's outputs."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import bladesmith
from bladesmith.config import Config
from bladesmith.errors import BladesmithError
from bladesmith.passes.torchscript import TorchScriptFreeze
from bladesmith.verify import compare_detections, detection_score_tolerance
from engine_testing import (
    Flags,
    cuda,
    optimized_tiny_detector,
    skip_where_torch_cannot_load_its_packages,
    tiny_detector,
)

QUICK = Config(warmup=0, iters=1)
TRACE = TorchScriptFreeze()


def optimized_net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 8, 8)
    optimized, spec, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    return optimized, spec, x


@pytest.fixture(scope="module")
def detector():
    return optimized_tiny_detector()


def test_torchscript_round_trip_keeps_outputs_and_spec(tmp_path):
    optimized, spec, x = optimized_net()
    path = bladesmith.save(optimized, tmp_path / "net.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.pt"]  # no temporary left
    loaded = bladesmith.load(path)
    torch.testing.assert_close(loaded(x), optimized(x))
    assert loaded.spec == spec


def test_torchscript_detector_round_trip_returns_detections(tmp_path, detector):
    optimized, spec, photos = detector
    assert spec.passes == ("fixed_shape", "memoized")
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "detector.pt"))
    expected = optimized(photos)
    got = loaded(photos)
    assert isinstance(got, list) and set(got[0]) == {"boxes", "scores", "labels"}
    assert compare_detections(expected, got).passed
    boxes, _, _, count = loaded.as_padded()(torch.stack(photos))
    assert count.tolist() == [len(got[0]["scores"])]


def test_onnx_round_trip_keeps_the_output_structure(tmp_path):
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 2, 3)

        def forward(self, x):
            y = self.conv(x)
            return {"features": y, "pooled": (y.mean(dim=(2, 3)), None)}

    x = torch.randn(2, 3, 8, 8)
    optimized, spec, _ = bladesmith.optimize(
        Heads(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    assert ".onnx" in spec.save_formats
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "heads.onnx"))
    expected, got = optimized(x), loaded(x)
    torch.testing.assert_close(got["features"], expected["features"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["pooled"][0], expected["pooled"][0], rtol=1e-4, atol=1e-5)
    assert got["pooled"][1] is None  # ONNX has no output for it: put back in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.onnx"]


def test_a_saved_onnx_refuses_other_values_of_arguments_held_as_constants(tmp_path):
    x = torch.randn(2, 4)
    model = Flags().eval()
    optimized, spec, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x, True)], config=QUICK, passes=[]
    )
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "flags.onnx"))
    torch.testing.assert_close(loaded(x, True), model(x, True), rtol=1e-4, atol=1e-5)
    with pytest.raises(BladesmithError, match="negate=False: .*exported with negate=True"):
        loaded(x, False)  # it held negate=True: never the answer for True, silently


@pytest.mark.slow
def test_aoti_package_round_trip_on_cpu(tmp_path):
    optimized, spec, x = optimized_net()
    assert ".pt2" in spec.untried_formats  # minutes to build: save checks it instead
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "net.pt2"), trust=True)
    torch.testing.assert_close(loaded(x), optimized(x), rtol=1e-4, atol=1e-5)
    assert loaded.spec.passes == spec.passes and loaded.device == torch.device("cpu")
    # It would read past a smaller batch, drop rows of a larger one and misread other
    # sizes or dtypes: each is refused in one line instead.
    for other in (x[:1], torch.cat([x, x]), x[..., :6, :6], x.double()):
        with pytest.raises(BladesmithError) as refused:
            loaded(other)
        message = str(refused.value)
        assert "\n" not in message and "it runs [2, 3, 8, 8] float32 only" in message
        assert "AOTInductor compiled it for these shapes" in message


class BatchBranch(nn.Module):
    """Code that depends on the batch size: a trace keeps the branch its example took."""

    def forward(self, x):
        if x.size(0) > 1:
            return x - x.mean(0, keepdim=True)
        return x * 2


def test_a_trace_that_keeps_its_batch_is_refused_at_others_and_one_that_follows_is_not(
    tmp_path,
):
    x = torch.randn(1, 3)
    optimized, _, _ = bladesmith.optimize(
        BatchBranch(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "branch.pt"))
    torch.testing.assert_close(loaded(x), x * 2)
    with pytest.raises(BladesmithError, match=r"runs \[1, \*\] float32 only \(traced at these "):
        loaded(torch.randn(3, 3))  # the trace would answer x * 2, silently
    assert loaded.batch_fixed  # and serve keeps to its batch
    net, _, batch = optimized_net()
    free = bladesmith.load(bladesmith.save(net, tmp_path / "net.pt"))
    assert not free.batch_fixed
    more = torch.cat([batch, batch, batch[:1]])
    torch.testing.assert_close(free(more), net(more), rtol=1e-4, atol=1e-5)
    with pytest.raises(BladesmithError, match=r"runs \[B, 3, 8, 8\] float32 only"):
        free(more[..., :7, :7])


class SlowBatchBranch(BatchBranch):
    """BatchBranch whose Python sleeps, which a trace drops: the torchscript pass is kept
    whatever the machine's load."""

    def forward(self, x):
        time.sleep(0.02)
        return super().forward(x)


def test_the_optimized_trace_refuses_other_batches_as_its_saved_file_does(tmp_path):
    x, wider = torch.randn(1, 3), torch.randn(1, 5)
    optimized, spec, _ = bladesmith.optimize(
        SlowBatchBranch(), device="cpu", test_data=[(x,), (wider,)], config=QUICK, passes=[TRACE]
    )
    assert spec.backend == "torchscript" and optimized.batch_fixed  # serve keeps to its batch
    for verified in (x, wider):  # in process, every size the test data had
        torch.testing.assert_close(optimized(verified), verified * 2)
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "branch.pt"))
    torch.testing.assert_close(loaded(wider), wider * 2)
    for module, source in ((optimized, "optimized module"), (loaded, str(tmp_path))):
        with pytest.raises(BladesmithError) as refused:
            module(torch.randn(3, 3))  # the trace would answer x * 2, silently
        message = str(refused.value)
        assert "\n" not in message and message.startswith(source), message
        assert "runs [1, *] float32 only (traced at these sizes; at another batch" in message


class SlowPooled(nn.Module):
    """A convolution pooled to one value per channel, at any size; sleeps as above."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        time.sleep(0.02)
        return self.conv(x).mean(dim=(2, 3))


def test_the_optimized_trace_that_follows_the_batch_runs_every_size_it_was_verified_at():
    torch.manual_seed(0)
    model, small, large = SlowPooled().eval(), torch.randn(2, 3, 8, 8), torch.randn(2, 3, 10, 10)
    optimized, spec, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(small,), (large,)], config=QUICK, passes=[TRACE]
    )
    assert spec.backend == "torchscript" and not optimized.batch_fixed
    for x in (large, torch.cat([small, small[:1]])):
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_float64_model_is_judged_and_described_in_float64():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    _, spec, _ = bladesmith.optimize(
        model.double(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    assert spec.dtype == "float64"
    assert spec.tolerance["why"].startswith("float64 outputs") and "2^-52" in spec.tolerance["why"]
    assert spec.tolerance["atol"] < 1e-9  # float32's rounding would allow ~1e-6


@cuda
def test_aoti_detector_round_trip_on_gpu(tmp_path):
    model, photos = tiny_detector()
    optimized, spec, _ = bladesmith.optimize(
        model, device="cuda", test_data=[(photos,)], config=QUICK
    )
    assert ".pt2" in spec.untried_formats
    skip_where_torch_cannot_load_its_packages("cuda")
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "detector.pt2"), trust=True)
    # AOTInductor compiles its own kernels (TF32 convolutions in float32): scores agree
    # within the detection tolerance of the network's dtype, not bit for bit.
    score_atol = detection_score_tolerance(getattr(torch, spec.dtype))
    comparison = compare_detections(optimized(photos), loaded(photos), score_atol=score_atol)
    assert comparison.passed, comparison.summary()


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    optimized, _, _ = optimized_net()

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch.jit, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        bladesmith.save(optimized, tmp_path / "net.pt")
    assert list(tmp_path.iterdir()) == []


def test_save_and_load_errors_say_what_is_wrong(tmp_path):
    optimized, _, _ = optimized_net()
    with pytest.raises(BladesmithError, match="must end with one of: .pt "):
        bladesmith.save(optimized, tmp_path / "net.bin")
    with pytest.raises(BladesmithError, match="module returned by bladesmith.optimize"):
        bladesmith.save(nn.Linear(2, 2), tmp_path / "net.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        bladesmith.load(tmp_path / "missing.pt")
    foreign = tmp_path / "foreign.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(foreign))
    with pytest.raises(BladesmithError, match="no bladesmith metadata"):
        bladesmith.load(foreign)
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "net.pt"))
    with pytest.raises(BladesmithError, match="module returned by bladesmith.optimize"):
        bladesmith.save(loaded, tmp_path / "again.pt")


def test_inputs_count_as_on_the_device_only_when_every_tensor_is():
    from bladesmith.devices import moved_to

    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    home = torch.device("meta")
    there = ([meta, meta], {"x": meta, "k": 3}, "text")
    assert moved_to(home, there) is there
    moved = moved_to(home, ({"nested": (cpu, {"deep": meta})},))
    assert [x.device for x in moved[0]["nested"][:1] + (moved[0]["nested"][1]["deep"],)] == [
        home,
        home,
    ]


def test_save_formats_are_those_saved_and_loaded_back_with_the_same_outputs(monkeypatch):
    from bladesmith.runtimes import torchscript

    freeze = torchscript.freeze

    def broken_freeze(module, args):  # a TorchScript that computes something else
        return freeze(Doubled(module), args)

    monkeypatch.setattr("bladesmith.runtimes.torchscript.freeze", broken_freeze)
    _, spec, _ = optimized_net()
    assert ".pt" not in spec.save_formats
    assert "outputs moved past tolerance" in spec.refused_formats[".pt"]


def test_a_bfloat16_result_refuses_onnx_with_the_reason_and_how_to_exclude_it(monkeypatch):
    from bladesmith.engine import result
    from bladesmith.spec import Spec

    tried = []
    monkeypatch.setattr(
        result, "try_formats", lambda _, formats, *rest: (tried.extend(formats) or (), {})
    )
    spec = Spec(
        "cpu", "bfloat16", ((1, 3, 8, 8),), "as_model", ("linear_bf16",), "eager", (".pt", ".onnx")
    )
    spec = result.with_tried_formats(spec, None, [], refused={}, judge=None, tolerance={})
    assert tried == [".pt"]  # .onnx is not even tried
    why = spec.refused_formats[".onnx"]
    assert why.startswith("bfloat16 was kept (linear_bf16), and ONNX Runtime's CPU kernels")
    assert "Config(exclude=('bf16', 'roi_heads_bf16', 'linear_bf16'))" in why
    assert "--exclude bf16 --exclude roi_heads_bf16 --exclude linear_bf16" in why
    assert "bladesmith bug" not in why


class Doubled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


def test_a_reloaded_detector_is_judged_as_the_gate_judges_its_dtype(
    tmp_path, detector, monkeypatch
):
    import dataclasses

    from bladesmith import fresh_load
    from bladesmith.fresh_load import reload_problem

    optimized, spec, _ = detector
    outputs = optimized(*optimized.example_args)
    moved = [{**image, "scores": image["scores"] - 0.015} for image in outputs]
    assert all(len(image["scores"]) for image in outputs)
    monkeypatch.setattr(fresh_load, "run_saved_each", lambda path, calls: ([moved], None))
    # float32 scores may move by 5e-3; bfloat16's by its rounding, as the gate allows.
    assert "score moved by 0.015" in reload_problem(optimized, tmp_path / "x.pt2")
    optimized.spec = dataclasses.replace(spec, dtype="bfloat16")
    try:
        assert reload_problem(optimized, tmp_path / "x.pt2") is None
    finally:
        optimized.spec = spec


class BakedBatch(nn.Module):
    """A graph that keeps its example's batch in ONNX: int() makes the size a constant."""

    def forward(self, x):
        return x.reshape(int(x.shape[0]), -1).sum(1)


def test_an_onnx_whose_graph_keeps_its_batch_is_saved_with_that_batch(tmp_path):
    x = torch.randn(2, 3, 4)
    optimized, spec, _ = bladesmith.optimize(
        BakedBatch(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "baked.onnx"))
    torch.testing.assert_close(loaded(x), x.sum((1, 2)))
    with pytest.raises(BladesmithError, match=r"exported for \(2, 3, 4\) float32 \(every size"):
        loaded(x[:1])  # not ONNX Runtime's error from the middle of the graph


def test_a_detector_refuses_images_of_another_size_or_dtype_in_process_and_loaded(
    tmp_path, detector
):
    optimized, _, photos = detector
    (photo,) = photos[:1]
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "detector.pt"))
    bigger = torch.nn.functional.pad(photo, (0, 8, 0, 8))
    as_uint8 = (photo * 255).to(torch.uint8)
    # Their traces have no size check: resized and normalised as if of their own size,
    # such images got detections with nothing to do with them.
    for module in (optimized, loaded):
        for image, got in ((bigger, f"{bigger.shape[1]}, {bigger.shape[2]}] float32"),
                           (as_uint8, "uint8")):  # fmt: skip
            with pytest.raises(BladesmithError, match=rf"got \[1, 3, .*{got}, but it runs \[B, 3"):
                module([image])
