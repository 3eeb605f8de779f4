"""Fixtures shared across test folders: the tiny detector and its photograph, built once
per module that asks for them; the user's operator library, built once per session."""

from __future__ import annotations

import pytest

from engine_testing import USER_OPS_SOURCE, tiny_detector


@pytest.fixture(scope="module")
def detector():
    return tiny_detector()


@pytest.fixture(scope="module")
def retinanet(detector):
    return detector[0]


@pytest.fixture(scope="module")
def photos(detector):
    return detector[1]


@pytest.fixture(scope="session")
def user_library(tmp_path_factory):
    """A user's operator library (``engine_testing.USER_OPERATOR``), compiled and loaded
    in this process: once per session, as a second library registering the same namespace
    would abort the process."""
    from torch.utils.cpp_extension import load_inline

    directory = tmp_path_factory.mktemp("userops")
    load_inline(
        "userops_test",
        cpp_sources=[USER_OPS_SOURCE],
        is_python_module=False,
        build_directory=str(directory),
    )
    return directory / "userops_test.so"
