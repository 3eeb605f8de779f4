"""argparse types shared by the commands: a bad value is one line naming the flag, before
any work starts."""

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


# What the commands say before making test images this large (float32 bytes).
IMAGES_NOTED_BYTES = 1 << 30


def check_images_fit(batches: tuple[int, ...], size: tuple[int, int]) -> None:
    """Refuse, in one line naming --batch and --input-size, test images (float32
    photographs, each batch made in turn and kept) that would not fit in the memory
    available now; say on stderr what they take when it is over 1 GiB."""
    import sys

    from bladesmith.errors import BladesmithError

    height, width = size
    needed = sum(batches) * 3 * height * width * 4
    said = f"--batch {batches_said(batches)} at --input-size {height}x{width}"
    available = available_memory()
    if available is not None and needed > available:
        raise BladesmithError(
            f"{said}: {_size(needed)} of test images, more than the {_size(available)} of "
            "memory available; give a smaller --batch or --input-size"
        )
    if needed > IMAGES_NOTED_BYTES:
        print(f"bladesmith: {said}: making {_size(needed)} of test images", file=sys.stderr)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (Linux: MemAvailable; else the
    free pages), or None where neither is known."""
    import os

    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _size(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB" if size >= 2**30 else f"{size / 2**20:,.1f} MiB"


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


def batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type for ``--batch``: one batch size, or several joined by commas
    (``1,8,32``), each >= 1 and given once."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a batch size or sizes joined by commas (1,8,32); got {text!r}"
        ) from None
    if min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(
            f"expected batch sizes >= 1, each given once; got {text!r}"
        )
    return sizes


def batches_said(sizes: int | tuple[int, ...]) -> str:
    """A ``--batch`` value as it is written: ``8``, ``1,8,32`` (export's takes one size,
    optimize's several)."""
    return str(sizes) if isinstance(sizes, int) else ",".join(map(str, sizes))


def port(text: str) -> int:
    """argparse type for a TCP port: 1 to 65535."""
    value = at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535; got {text!r}")
    return value


def add_trust_option(parser: argparse.ArgumentParser) -> None:
    """``--trust``: load a file whose loading runs code it brings (native libraries,
    compiled code, TorchScript outside the operator allowlist, pickles), saying what
    runs on stderr first (``bladesmith.trust``, docs/security.md)."""
    parser.add_argument(
        "--trust",
        action="store_true",
        help="load the file even where that runs code its maker wrote (its operator "
        "libraries, compiled .pt2 code, TorchScript outside the operator allowlist, "
        "pickles): only for files from someone you trust (docs/security.md)",
    )


def add_load_library(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--load-library PATH`` (repeatable): the user's operator libraries, loaded
    (``torch.ops.load_library``) before the command reads a model; ``note`` says more
    in the help, after "loaded first"."""
    parser.add_argument(
        "--load-library",
        action="append",
        default=[],
        metavar="PATH",
        help=f"a shared library of the model's own operators (TORCH_LIBRARY), loaded first"
        f"{note}; repeatable",
    )


def add_library_options(parser: argparse.ArgumentParser) -> None:
    """``--load-library`` and ``--onnx-op NAME`` (repeatable): such an operator exported to
    ONNX as a custom node that ONNX Runtime runs with its PyTorch kernel
    (``bladesmith.onnx.register_op(NAME)``). ``main`` applies both before the command
    runs."""
    add_load_library(parser)
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


def readable_file(text: str) -> str:
    """argparse type for a file to read: it exists, is a file, is readable, is not empty."""
    from bladesmith._files import unreadable

    problem = unreadable(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def output_file(*suffixes: str):
    """argparse type for a file to write: its folder exists and is writable, it is not a
    folder, and it ends with one of ``suffixes`` (any, when none are given). Checked
    before any work starts, so that nothing is lost to a bad path at the end."""

    def parse(text: str) -> str:
        from pathlib import Path

        from bladesmith._files import unwritable

        problem = unwritable(text)
        if problem:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {problem}")
        if suffixes and Path(text).suffix not in suffixes:
            raise argparse.ArgumentTypeError(f"{text}: expected a {' or '.join(suffixes)} file")
        return text

    return parse


def save_file(text: str) -> str:
    """argparse type for an artifact to write: ``output_file``'s checks, its suffix one of
    a save format's (``runtimes.formats.FORMATS``, imported only once one is given)."""
    from bladesmith.runtimes.formats import FORMATS

    return output_file(*FORMATS)(text)


def existing_folder(text: str) -> str:
    """argparse type for a folder that exists."""
    from pathlib import Path

    if not Path(text).is_dir():
        what = "a file, not a folder" if Path(text).exists() else "no such folder"
        raise argparse.ArgumentTypeError(f"{text}: {what}")
    return text


def pass_name(text: str) -> str:
    """argparse type for the name of a registered pass."""
    from bladesmith.passes import registry

    names = registry.names()
    if text not in names:
        raise argparse.ArgumentTypeError(f"no pass named {text!r}; passes are {', '.join(names)}")
    return text
