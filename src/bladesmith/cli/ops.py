"""``bladesmith ops build``: compile the custom-operator library ahead of time."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ops",
        help="custom operators (torch.ops.bladesmith)",
        description="Custom operators for detection post-processing (torch.ops.bladesmith).",
    )
    actions = parser.add_subparsers(dest="ops_command", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="build the operator library now rather than on first use",
        description=(
            "Build (if needed) and load the operator library, and print the path of the "
            "shared library; TorchScript and AOTInductor artifacts load it with "
            "torch.ops.load_library(path)."
        ),
    )
    cuda = build.add_mutually_exclusive_group()
    cuda.add_argument(
        "--cuda",
        dest="cuda",
        action="store_true",
        default=None,
        help="compile the CUDA kernels in, even without a GPU here (default: if a GPU and "
        "nvcc are found, or BLADESMITH_OPS_CUDA=1)",
    )
    cuda.add_argument(
        "--no-cuda", dest="cuda", action="store_false", help="build the CPU kernels only"
    )
    build.add_argument("--verbose", action="store_true", help="show the compiler's output")
    build.set_defaults(func=_build)


def _build(args: argparse.Namespace) -> int:
    from bladesmith.ops.build import load_library

    print(load_library(cuda=args.cuda, verbose=args.verbose))
    return 0
