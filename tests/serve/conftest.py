"""Artifacts to serve, saved by the tests themselves."""

from __future__ import annotations

import pytest
from serve_testing import QUICK, optimized_net

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
def detector_artifact(tmp_path_factory):
    """torchvision's RetinaNet (ResNet-18 FPN, 128x160, random weights) as the fixed-shape
    padded pipeline, saved as TorchScript; and its photograph."""
    from bladesmith.passes.fixed_shape import FixedShape
    from engine_testing import Memoized, tiny_detector

    model, photos = tiny_detector()
    # Memoized keeps fixed_shape whatever the timings; save() traces the pipeline.
    optimized, _, _ = bladesmith.optimize(
        model,
        device="cpu",
        test_data=[(photos,)],
        config=QUICK,
        passes=[FixedShape(), Memoized()],
    )
    path = bladesmith.save(optimized, tmp_path_factory.mktemp("detector") / "detector.pt")
    return path, photos
