import pytest


@pytest.fixture(scope="session", autouse=True)
def ops_library() -> str:
    """Builds the operator library once per session (cached across sessions)."""
    from bladesmith.ops import load_library

    return load_library()
