"""The ``bladesmith`` command: one subcommand per job.

Each subcommand lives beside the code it drives, in a module with
``add_parser(subparsers)`` that registers it and sets ``func(args) -> int``.
Those modules import torch and friends inside ``func``, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order of `bladesmith --help`.
_COMMAND_MODULES = (
    "bladesmith.engine_cli",
    "bladesmith.checkup_cli",
    "bladesmith.ops.cli",
    "bladesmith.onnx.check_cli",
    "bladesmith.onnx.export_cli",
    "bladesmith.serve.cli",
)


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


def build_parser() -> argparse.ArgumentParser:
    from bladesmith import __version__

    parser = argparse.ArgumentParser(
        prog="bladesmith",
        description=(
            "Turn a PyTorch model into a faster, verified, deployable artifact, "
            "and say where it will run."
        ),
    )
    parser.add_argument("--version", action="version", version=f"bladesmith {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from bladesmith.errors import BladesmithError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BladesmithError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
