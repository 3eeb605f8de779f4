"""Helpers shared by the engine's and the passes' tests: a small detector, a pass that
makes any candidate fast, so that what the engine keeps does not depend on the machine's
load, a model a compiling pass beats whatever the load, batch norms worth folding, the
detector through chosen passes, every torchvision detector family small, the mark of
GPU-only tests, and a user's operator library (its source; tests/conftest.py builds it)."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from bladesmith.config import Config
from bladesmith.passes import Candidate, Context, Pass

IMAGE_SIZE = (128, 160)

# Fewer proposals and detections than torchvision's defaults: an R-CNN's heads then run
# on fewer boxes (a ResNet-50 Mask or Keypoint R-CNN takes seconds a call on a loaded CPU).
FEWER_BOXES = dict(
    rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_test=50, box_detections_per_img=20
)


def _keypoint_rcnn():
    from torchvision.models.detection import keypointrcnn_resnet50_fpn

    # No family builds it: random weights and every box kept, so that it detects.
    torch.manual_seed(0)
    return keypointrcnn_resnet50_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=2,
        num_keypoints=5,
        min_size=min(IMAGE_SIZE),
        max_size=max(IMAGE_SIZE),
        box_score_thresh=0.0,
        **FEWER_BOXES,
    ).eval()


def _family_builders() -> dict:
    from bladesmith.families.fcos import build_fcos
    from bladesmith.families.rcnn import build_rcnn
    from bladesmith.families.retinanet import build_retinanet
    from bladesmith.families.ssd import build_ssd

    size = IMAGE_SIZE
    return {
        "retinanet": lambda: build_retinanet(size, num_classes=3, backbone="resnet18"),
        "fcos": lambda: build_fcos(size, num_classes=3, backbone="resnet18"),
        "ssd": lambda: build_ssd("ssd300_vgg16", num_classes=3),
        "ssdlite": lambda: build_ssd("ssdlite320_mobilenet_v3_large", num_classes=3),
        "faster_rcnn": lambda: build_rcnn(
            "fasterrcnn_mobilenet_v3_large_320_fpn", size, num_classes=3
        ),
        "mask_rcnn": lambda: build_rcnn(
            "maskrcnn_resnet50_fpn", size, num_classes=3, **FEWER_BOXES
        ),
        "keypoint_rcnn": _keypoint_rcnn,
    }


# Every torchvision detector family, each at its smallest backbone at IMAGE_SIZE (SSD and
# SSDlite resize to their own); random weights calibrated to a trained model's load, so
# that each detects.
DETECTORS = _family_builders()

# A user's operator library, as `TORCH_LIBRARY` + `torch.utils.cpp_extension` make one
# (no fake kernel).
USER_OPS_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor scale_clip(const at::Tensor& x, double scale, double limit) {
  return (x * scale).clamp(-limit, limit);
}

TORCH_LIBRARY(userops_test, m) {
  m.def("scale_clip(Tensor x, float scale, float limit) -> Tensor");
}
TORCH_LIBRARY_IMPL(userops_test, CPU, m) { m.impl("scale_clip", scale_clip); }
TORCH_LIBRARY_IMPL(userops_test, CUDA, m) { m.impl("scale_clip", scale_clip); }
"""
USER_OPERATOR = "userops_test::scale_clip"


def cuda(test):
    """GPU-only: marked `cuda` (pytest -m cuda) and skipped where there is none."""
    needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.cuda(needs_gpu(test))


def context_for(args: tuple, device="cpu", level="o1", kept=()) -> Context:
    """A pass's context for a test: ``args`` the one test input, quick timing."""
    return Context(
        device=torch.device(device),
        level=level,
        config=Config(warmup=0, iters=2),
        example_args=args,
        test_args=[args],
        kept=list(kept),
    )


def randomize_norms(net: nn.Module) -> nn.Module:
    """``net`` in eval mode, its batch norms changing what they normalise, so that a fold
    that drops one shows in the outputs."""
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            module.weight.data.uniform_(0.5, 2)
            module.bias.data.uniform_(-1, 1)
    return net.eval()


def detections_through(model, photos, *pass_lists, device="cuda") -> list:
    """The detections of ``model`` on ``photos`` as a fixed-shape pipeline on ``device``,
    then through each list of passes in turn (applied in order, without the gate)."""
    from bladesmith.artifact import OptimizedModule
    from bladesmith.passes.fixed_shape import FixedShape

    images = [p.to(device) for p in photos]
    context = context_for((images,), device=device)
    adapted = FixedShape().apply(
        Candidate(copy.deepcopy(model).to(device), context.device), context
    )
    outputs = []
    for passes in pass_lists:
        candidate = adapted
        for each in passes:
            candidate = each.apply(candidate, context)
        with torch.no_grad():
            outputs.append(OptimizedModule.from_candidate(candidate)(images))
    return outputs


def tiny_detector():
    """A RetinaNet (ResNet-18 FPN, 3 classes) at IMAGE_SIZE with a realistic load, and
    one photograph for it: a copy of each for every caller, built once per test run
    (the calibration costs ten times the copy)."""
    model, photos = _built_tiny_detector()
    return copy.deepcopy(model), [photo.clone() for photo in photos]


@functools.cache
def _built_tiny_detector():
    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    model = build_retinanet(IMAGE_SIZE, backbone="resnet18", num_classes=3)
    return model, list(sample_images(1, IMAGE_SIZE))


def optimized_tiny_detector():
    """The tiny detector optimized on the CPU as its fixed-shape pipeline, with its spec
    and photograph. Memoized keeps fixed_shape whatever the timings; ``save`` traces the
    pipeline itself, so a saved artifact computes for real."""
    import bladesmith
    from bladesmith.passes.fixed_shape import FixedShape

    model, photos = tiny_detector()
    optimized, spec, _ = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[(photos,)],
        config=Config(warmup=0, iters=1),
        passes=[FixedShape(), Memoized()],
    )
    return optimized, spec, photos


class Memoized(Pass):
    """Runs the candidate once on the example input and returns copies of those outputs
    whenever it gets that input again (any other input is computed): accurate, on the
    held-out inputs too, and far faster than anything real on the input that is timed,
    so every pass before it is kept whatever the timing noise of a shared machine."""

    name = "memoized"

    def apply(self, candidate, context):
        example = candidate.runner_args(context.example_args)
        with torch.no_grad():
            outputs = candidate(*example)

        def replay(*args, **kwargs):
            if kwargs or not _same_values(args, example):
                with torch.no_grad():
                    return candidate(*args, **kwargs)
            return pytree.tree_map(
                lambda x: x.clone() if isinstance(x, torch.Tensor) else x, outputs
            )

        return candidate.with_runner(replay, self.name, wraps=True)


def _same_values(args, example) -> bool:
    leaves, other = pytree.tree_leaves(args), pytree.tree_leaves(example)
    return len(leaves) == len(other) and all(
        x is y or (isinstance(x, torch.Tensor) and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(leaves, other)
    )


class Wasteful(nn.Module):
    """``inner``, after a large matrix product whose result it throws away: eager computes
    it, a compiler or converter (Inductor; the ONNX export OpenVINO converts) drops it as
    dead code, so the pass that compiles the model wins by many times whatever the load
    of a shared machine. For tests of what such a pass keeps and saves, not of its speed
    (on a small net its real win can be within the noise, and the result run eager). A GPU
    needs a larger ``size`` for the product to dominate."""

    def __init__(self, inner: nn.Module, size: int = 768):
        super().__init__()
        self.inner = inner
        square = torch.rand(size, size, generator=torch.Generator().manual_seed(0))
        self.register_buffer("square", square)

    def forward(self, *args):
        self.square @ self.square
        return self.inner(*args)


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)
    ).eval()


class Flags(nn.Module):
    """A Linear layer and a non-tensor argument, which traces and ONNX exports take as a
    constant."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, negate: bool):
        y = self.linear(x)
        return -y if negate else y


_TORCH_ONLY = """
import sys, torch
run = torch._inductor.aoti_load_package(sys.argv[1])
run(torch.randn(1, 3, 16, 16, device=sys.argv[2]))
"""


@functools.cache
def torch_package_problem(device: str) -> str | None:
    """Why a package torch alone makes (a small conv net, no bladesmith) does not load
    and run in a new process on ``device``, or None when it does: a machine whose torch
    cannot load its own AOTInductor packages cannot load bladesmith's either. Found
    once per device and test run."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).to(device).eval()
    x = torch.randn(1, 3, 16, 16, device=device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "torch-only.pt2"
        exported = torch.export.export(model, (x,), strict=False)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
        command = [sys.executable, "-c", _TORCH_ONLY, str(path), device]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return "no answer within 600 s"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return f"exit {done.returncode} {last}".strip()


def skip_where_torch_cannot_load_its_packages(device: str) -> None:
    """Skip a test of a ``.pt2`` on ``device`` where torch cannot load its own packages
    (torch 2.11 on the H200: docs/limits.md): bladesmith's save refuses there."""
    problem = torch_package_problem(device)
    if problem:
        pytest.skip(f"torch's own AOTInductor packages do not load here: {problem}")
