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
