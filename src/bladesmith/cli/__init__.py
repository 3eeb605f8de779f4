"""The ``bladesmith`` command: one module of this package per command group.

Each command module has ``add_parser(subparsers)``, which registers its commands and
sets ``func(args) -> int``; it imports torch and friends inside ``func``, so that
``--help`` stays fast. ``args`` holds the argument types they share, ``models`` the
one loader of the models they take.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order of `bladesmith --help`.
_COMMAND_MODULES = (
    "bladesmith.cli.optimize",
    "bladesmith.cli.doctor",
    "bladesmith.cli.ops",
    "bladesmith.onnx.check_cli",
    "bladesmith.cli.export",
)


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
