"""Fixtures shared across test folders: the tiny detector and its photograph, built once
per module that asks for them."""

from __future__ import annotations

import pytest

from engine_testing import tiny_detector


@pytest.fixture(scope="module")
def detector():
    return tiny_detector()


@pytest.fixture(scope="module")
def retinanet(detector):
    return detector[0]


@pytest.fixture(scope="module")
def photos(detector):
    return detector[1]
