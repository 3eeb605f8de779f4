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
    "bladesmith.cli.check",
    "bladesmith.cli.export",
    "bladesmith.cli.serve",
)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr (exit code 2), naming the
    flag and where to read more, rather than the usage block and the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from bladesmith import __version__

    parser = _Parser(
        prog="bladesmith",
        description=(
            "Turn a PyTorch model into a faster, verified, deployable artifact, "
            "and say where it will run."
        ),
        epilog=(
            "Exit status 2: bad input (a file, a flag), said in one line on stderr; "
            "--debug adds the traceback."
        ),
    )
    parser.add_argument("--version", action="version", version=f"bladesmith {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error as well"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def _load_libraries(args) -> None:
    """The user's operator libraries and ONNX translations (``cli.args.add_library_options``)."""
    if getattr(args, "load_library", None):
        from bladesmith.ops import libraries

        libraries.load_all(args.load_library)
    for name in getattr(args, "onnx_op", None) or ():
        from bladesmith.onnx import register_op

        register_op(name)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A BladesmithError (bad input the user can fix: a file, a flag) is
    one line on stderr and its ``exit_code`` (2; 1 for a server that did not stop
    cleanly); any other error one line and exit code 1 (a bug to report); ``--debug``
    prints the traceback before that line. A closed stdout (the reader of a pipe
    stopped) ends the command quietly with EXIT_BROKEN_PIPE."""
    import traceback

    from bladesmith.errors import BladesmithError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        _load_libraries(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("bladesmith: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except Exception as error:
        if args.debug:
            traceback.print_exc()
        if isinstance(error, BladesmithError):
            print(f"bladesmith {args.command}: error: {_one_line(error)}", file=sys.stderr)
            return error.exit_code
        print(
            f"bladesmith {args.command}: unexpected error: {type(error).__name__}: "
            f"{_one_line(error)} (--debug shows where; please report it)",
            file=sys.stderr,
        )
        return 1


# 128 + SIGPIPE: what a command killed by the signal reports to the shell.
EXIT_BROKEN_PIPE = 141


def _stdout_closed() -> int:
    """The reader of stdout went away (``bladesmith check --json m.onnx | head``): stop
    quietly, as ``cat`` does. stdout is pointed at /dev/null, so that the interpreter's
    last flush at exit has nowhere to fail either."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout has no file descriptor (captured)
        pass
    return EXIT_BROKEN_PIPE


def _one_line(error: BaseException) -> str:
    from bladesmith.errors import one_line

    return one_line(str(error)) or type(error).__name__
