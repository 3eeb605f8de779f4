"""errors: the one-line descriptions of errors in reports and on the command line."""

from __future__ import annotations

import torch

from bladesmith.errors import describe, without_values


def test_describe_is_one_line_without_tensor_values():
    """torch's tracer prints every output tensor into its message, over many lines."""
    values = repr(torch.rand(4, 4))
    error = RuntimeError(f"Tracer cannot infer type of {{'out': {values}}}\n:List inputs must")
    expected = "RuntimeError: Tracer cannot infer type of {'out': tensor(...)} :List inputs must"
    assert describe(error) == expected
    assert without_values("a tensor(1.) and tensor([[1, (2)]])") == "a tensor(...) and tensor(...)"
