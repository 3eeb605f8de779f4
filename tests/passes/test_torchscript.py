"""torchscript (and onnxruntime): runners with the module's outputs."""

from __future__ import annotations

import torch

from bladesmith.passes import Candidate
from bladesmith.passes.onnxruntime import OnnxRuntime
from bladesmith.passes.torchscript import TorchScriptFreeze
from engine_testing import (
    context_for,
    conv_net,
    tiny_detector,
)


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


class DictOut(torch.nn.Module):
    """A segmentation model's form: a dict of tensors (torchvision's return OrderedDicts)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return {"out": y, "aux": y.relu()}


def test_torchscript_freezes_a_model_that_returns_a_dict_and_saves_it(tmp_path):
    """The tracer refuses dict outputs unless strict=False; their keys are the model's
    code, so the trace holds. The .pt loads in a new process and gives the dict."""
    import bladesmith
    from bladesmith import fresh_load
    from bladesmith.config import Config

    torch.manual_seed(0)
    model, x = DictOut().eval(), torch.rand(1, 3, 16, 16)
    candidate = Candidate(module=model, device=torch.device("cpu"))
    scripted = TorchScriptFreeze().apply(candidate, context_for((x,)))
    out = scripted(x)
    assert isinstance(out, dict) and out.keys() == {"out", "aux"}
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)

    config = Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)
    optimized, spec, report = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=config, passes=[TorchScriptFreeze()]
    )
    (record,) = report.optimizations
    assert record.status != "failed", record.reason
    assert ".pt" in spec.save_formats, spec.refused_formats
    outputs, problem = fresh_load.run_saved(bladesmith.save(optimized, tmp_path / "m.pt"), (x,))
    assert problem is None, problem
    assert isinstance(outputs, dict) and outputs.keys() == {"out", "aux"}
    torch.testing.assert_close(outputs, model(x), rtol=1e-4, atol=1e-5)


def test_outputs_torchscript_cannot_type_fail_in_one_line_without_values():
    """A list of a tensor and a dict has no TorchScript type: the failure names the
    structure, never the tensors' values (the tracer's own message prints them all)."""
    from bladesmith.errors import BladesmithError

    class Mixed(torch.nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "aux": (x, [x.sum(1), {"n": x.max()}])}

    x = torch.rand(2, 8)
    candidate = Candidate(module=Mixed(), device=torch.device("cpu"))
    try:
        TorchScriptFreeze().apply(candidate, context_for((x,)))
    except BladesmithError as error:
        message = str(error)
    else:
        raise AssertionError("a list of a tensor and a dict was traced")
    assert "\n" not in message and "tensor(" not in message, message
    assert "{'logits': Tensor, 'aux': (Tensor, [Tensor, {'n': Tensor}])}" in message


def test_an_eager_torchvision_detector_is_skipped_and_its_pipeline_is_not():
    """A trace would freeze the test image's number of detections (before: "failed
    torchscript: RuntimeError: Only tensors, lists, tuples of tensors ...")."""
    from bladesmith.passes.fixed_shape import FixedShape

    model, photos = tiny_detector()
    context = context_for((photos,))
    eager = Candidate(model, torch.device("cpu"))
    assert "fixed_shape" in TorchScriptFreeze().skip_reason(eager, context)
    pipeline = FixedShape().apply(eager, context)
    assert TorchScriptFreeze().skip_reason(pipeline, context) is None


def test_a_torch_export_program_is_traced_and_frozen():
    from torchvision.models import resnet18

    model = resnet18().eval()
    x = torch.randn(1, 3, 32, 32)
    program = torch.export.export(model, (x,)).module()  # refuses eval()
    candidate = Candidate(module=program, device=torch.device("cpu"))
    frozen = TorchScriptFreeze().apply(candidate, context_for((x,)))
    assert frozen.backend == "torchscript"
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), model(x), rtol=1e-4, atol=1e-4)
