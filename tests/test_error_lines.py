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


def test_a_torchscript_stack_is_folded_to_the_error_it_ends_with():
    from bladesmith.errors import one_line

    gray = torch.jit.trace(torch.nn.Conv2d(1, 4, 3), torch.rand(1, 1, 8, 8))
    try:
        gray(torch.rand(1, 3, 8, 8))
    except RuntimeError as error:
        wrapped = f"export failed ({type(error).__name__}: {error}). Check the model"
    line = one_line(wrapped)
    assert line.startswith("export failed (RuntimeError: Given groups=1"), line
    assert line.endswith("but got 3 channels instead). Check the model"), line
    assert "HERE" not in line and "Traceback" not in line


def test_a_kernels_source_location_is_left_out():
    """torchvision's kernels name the file they were built from, on its build machine."""
    error = RuntimeError(
        "operator(), /__w/vision/vision/pytorch/vision/torchvision/csrc/ops/cpu/"
        "nms_kernel.cpp:122, \"nms_kernel\" not implemented for 'BFloat16'"
    )
    assert describe(error) == "RuntimeError: \"nms_kernel\" not implemented for 'BFloat16'"


def test_an_error_without_a_message_is_described_by_the_error_it_was_raised_from():
    try:
        try:
            {}["anchors"]
        except KeyError as error:
            raise RuntimeError("  \n") from error
    except RuntimeError as error:
        described = describe(error)
    assert described == "RuntimeError with no message, raised from KeyError: 'anchors'"
    assert describe(RuntimeError()) == "RuntimeError with no message"
    # TorchScript's compiler starts its messages on a new line.
    assert describe(RuntimeError("\nUnknown builtin op: a::b.\n")) == (
        "RuntimeError: Unknown builtin op: a::b."
    )
