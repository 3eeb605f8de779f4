"""argparse types shared by the commands."""

from __future__ import annotations

import argparse


def input_size(text: str) -> tuple[int, int]:
    """argparse type for HxW, e.g. 480x640."""
    try:
        height, width = (int(side) for side in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW, e.g. 480x640; got {text!r}") from None
    if height <= 0 or width <= 0:
        raise argparse.ArgumentTypeError(f"sides must be positive; got {text!r}")
    return height, width


def at_least(minimum: int):
    """argparse type for an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}; got {text!r}")
        return value

    return parse


def add_library_options(parser: argparse.ArgumentParser) -> None:
    """``--load-library PATH`` (repeatable): the user's operator libraries, loaded
    (``torch.ops.load_library``) before the command reads a model; ``--onnx-op NAME``
    (repeatable): such an operator exported to ONNX as a custom node that ONNX Runtime
    runs with its PyTorch kernel (``bladesmith.onnx.register_op(NAME)``). ``main``
    applies both before the command runs."""
    parser.add_argument(
        "--load-library",
        action="append",
        default=[],
        metavar="PATH",
        help="a shared library of the model's own operators (TORCH_LIBRARY); repeatable",
    )
    parser.add_argument(
        "--onnx-op",
        action="append",
        default=[],
        metavar="NAMESPACE::OP",
        help=(
            "export this operator to ONNX as a custom node run by its PyTorch kernel "
            "(Python: bladesmith.onnx.register_op, which also takes onnxscript lowerings); "
            "repeatable"
        ),
    )
