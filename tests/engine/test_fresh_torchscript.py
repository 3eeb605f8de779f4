"""A TorchScript model that has never been called is optimized as it is given, in a new
process (TorchScript's executors keep their state per process, and per module: a model
called once before ``optimize`` would hide what its first calls do).

TorchScript's profiling executor optimizes a graph on its first call, under whatever
dispatch mode is active: the operator recording of the reference run
(``ops.libraries.recording``) then sees the constants it folds. torch hands a dispatch
mode a wrapped number (the tensor a trace holds for ``x * 100``) as a plain Python
number, and an operator that takes no number for a tensor (``_local_scalar_dense``)
refused it: "Expected a value of type 'Tensor' for argument 'self' but instead found
type 'int'. Value: 100", and optimize said the model failed on its test inputs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bladesmith.images import sample_images
from engine_testing import DETECTORS, IMAGE_SIZE

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"

# The PAI-Blade detection tutorial's form: a scripted wrapper taking a list of
# {"image": uint8-range tensor} dicts around a traced network, built in the script
# itself (a traced constant keeps its wrapped-number mark until the file is saved).
WRAPPED = """
from typing import Dict, List

import torch
from torch import Tensor, nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x) * 100  # traced as a tensor constant


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, batched_inputs: List[Dict[str, Tensor]]):
        return self.inner(torch.stack([d["image"] / 255.0 for d in batched_inputs]))


def wrapped_model():
    torch.manual_seed(0)
    traced = torch.jit.trace(Net().eval(), torch.rand(1, 3, 32, 32))
    return torch.jit.script(Wrapper(traced).eval())
"""


def run_script(code: str, directory: Path) -> subprocess.CompletedProcess:
    """``code`` as a file of its own (TorchScript reads the source of what it scripts)
    in a new interpreter, with this tree's sources and test helpers."""
    script = directory / "script.py"
    script.write_text(textwrap.dedent(code))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )


NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# On a GPU, a CUDA operator reads a CPU scalar operand with item() (_local_scalar_dense).
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, NEEDS_GPU])]
)
def test_a_scripted_list_of_dicts_model_is_optimized_before_its_first_call(device, tmp_path):
    (tmp_path / "wrapped.py").write_text(WRAPPED)
    done = run_script(
        """
        import torch, bladesmith
        from bladesmith.passes.torchscript import TorchScriptFreeze
        from wrapped import wrapped_model

        device = DEVICE
        config = bladesmith.Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)
        image = torch.rand(3, 32, 32, device=device) * 255
        scripted = wrapped_model().to(device)
        torch.jit.save(scripted, "wrapped.pt")
        # Neither model has been called: as built in this process, and loaded from disk.
        for model in (scripted, torch.jit.load("wrapped.pt", map_location=device)):
            optimized, spec, report = bladesmith.optimize(
                model, "o1", device, test_data=[([{"image": image}],)], config=config,
                passes=[TorchScriptFreeze()],
            )
            assert report.accuracy["passed"], report.accuracy["summary"]
            assert ".pt" in spec.save_formats, spec.refused_formats
            other = torch.rand(3, 32, 32, device=device) * 255
            # Freezing fuses the convolutions' arithmetic: 1.5e-5 apart in one run here.
            torch.testing.assert_close(
                optimized([{"image": other}]), model([{"image": other}]), rtol=1e-4, atol=1e-4
            )
        print("ok")
        """.replace("DEVICE", repr(device)),
        tmp_path,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


SIZE = IMAGE_SIZE


@pytest.mark.slow
@pytest.mark.parametrize("name", DETECTORS)
def test_a_scripted_detector_loaded_from_disk_is_optimized_before_its_first_call(name, tmp_path):
    model = DETECTORS[name]()
    with pytest.warns(FutureWarning):  # torch.jit.script and save are deprecated
        torch.jit.save(torch.jit.script(model), tmp_path / "detector.pt")
    photos = list(sample_images(3, SIZE))
    with torch.no_grad():
        expected = [model([photo]) for photo in photos]
    assert min(len(each[0]["scores"]) for each in expected) > 0  # a comparison of something
    torch.save((photos, expected), tmp_path / "io.pt")
    done = run_script(
        """
        import torch, torchvision  # torchvision's operators, which the file calls
        import bladesmith
        from bladesmith.verify import compare_detections
        from engine_testing import Memoized

        photos, expected = torch.load("io.pt")
        loaded = torch.jit.load("detector.pt")  # never called before optimize
        config = bladesmith.Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)
        optimized, spec, report = bladesmith.optimize(
            loaded, "o1", "cpu", test_data=[([photos[0]],)], config=config,
            passes=[Memoized()],
        )
        assert report.accuracy["passed"], report.accuracy["summary"]
        assert spec.passes == ("memoized",), report.optimizations
        assert ".pt" in spec.save_formats, spec.refused_formats
        for photo, detections in zip(photos, expected):
            losses, answered = optimized([photo])
            result = compare_detections(detections, answered, iou_threshold=0.999, min_f1=1.0)
            assert result.passed, result.summary()
        print("ok")
        """,
        tmp_path,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
