"""Artifacts to serve, saved by the tests themselves."""

from __future__ import annotations

import pytest
import torch
from serve_testing import (
    MASK_SIZE,
    NET_BATCH,
    QUICK,
    LastStep,
    ScaleClips,
    Spin,
    Tagger,
    optimized_net,
    tiny_mask_rcnn,
    typed_inputs,
)

import bladesmith


@pytest.fixture(scope="session")
def net_artifacts(tmp_path_factory):
    """The tiny net saved as TorchScript and ONNX: {suffix: path}."""
    folder = tmp_path_factory.mktemp("net")
    optimized = optimized_net()
    return {
        suffix: bladesmith.save(optimized, folder / f"net{suffix}") for suffix in (".pt", ".onnx")
    }


@pytest.fixture(scope="session")
def spin_artifact(tmp_path_factory):
    """``Spin`` scripted (its loop kept), saved as TorchScript: spin.pt."""
    model = torch.jit.script(Spin().eval())
    test_data = [(torch.randn(NET_BATCH, 16), torch.full((NET_BATCH,), 3))]
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=test_data, config=QUICK, passes=[]
    )
    return bladesmith.save(optimized, tmp_path_factory.mktemp("spin") / "spin.pt")


@pytest.fixture(scope="session")
def detector_artifact(tmp_path_factory):
    """torchvision's RetinaNet (ResNet-18 FPN, 128x160, random weights) as the fixed-shape
    padded pipeline, saved as TorchScript; and its photograph."""
    from engine_testing import optimized_tiny_detector

    optimized, _, photos = optimized_tiny_detector()
    path = bladesmith.save(optimized, tmp_path_factory.mktemp("detector") / "detector.pt")
    return path, photos


@pytest.fixture(scope="session")
def mask_artifact(tmp_path_factory):
    """The tiny Mask R-CNN's fixed-shape padded pipeline at batch 2 (served with masks
    besides the detections), saved as TorchScript; and its two photographs."""
    from bladesmith.images import sample_images
    from bladesmith.passes.fixed_shape import FixedShape
    from engine_testing import Memoized

    model = tiny_mask_rcnn()
    photos = sample_images(2, MASK_SIZE)
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(list(photos),)], config=QUICK,
        passes=[FixedShape(), Memoized()],
    )  # fmt: skip
    path = bladesmith.save(optimized, tmp_path_factory.mktemp("mask") / "mask.pt")
    return path, photos


@pytest.fixture(scope="session")
def user_op_artifact(user_library, tmp_path_factory):
    """A TorchScript model calling the user's operator, saved as scaled.pt (its library in
    scaled.pt.libs/); and the model."""
    model = torch.jit.script(ScaleClips().eval())
    x = torch.randn(4, 6)
    optimized, _, _ = bladesmith.optimize(
        model, device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    return bladesmith.save(optimized, tmp_path_factory.mktemp("scaled") / "scaled.pt"), model


@pytest.fixture(scope="session")
def typed_artifacts(tmp_path_factory):
    """Models whose inputs are not all float32, saved: {file name: (path, model)} for
    tagger.pt and tagger.onnx (int64 ids, float32 mask) and laststep.pt (float64, and
    int64 one per row)."""
    folder = tmp_path_factory.mktemp("typed")
    saved = {}
    for files, model in (((".pt", ".onnx"), Tagger()), ((".pt",), LastStep())):
        model.eval()
        optimized, _, _ = bladesmith.optimize(
            model, device="cpu", test_data=[typed_inputs(model)], config=QUICK, passes=[]
        )
        for suffix in files:
            name = f"{type(model).__name__.lower()}{suffix}"
            saved[name] = (bladesmith.save(optimized, folder / name), model)
    return saved
