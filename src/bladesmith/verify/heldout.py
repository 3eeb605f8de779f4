"""Held-out inputs: arguments of the test data's signature that no pass saw, on which a
result is checked against the model as given besides the test data itself.

A pass can be right on the test inputs alone: a trace that held its example as a
constant answers the test data exactly, and every other input with the same answer.
Each held-out input keeps every structure, shape and dtype of a test entry and changes
its values: an image (floats in [0, 1] or [0, 255], 1 or 3 channels) becomes another
photograph, or the image mirrored with a little noise; other floats move by a tenth of
their spread (and are reversed along their last axis); integers with more than two
values (token ids) are drawn again within their range. Masks, flags, lengths (integers
of at most two values), booleans and non-tensor arguments are kept: other values
there could ask what the model was never meant to answer.

Calibration inputs (what a quantizing pass sets its ranges on, unless
``Config.calibration_data`` gives them) are derived the same way and are never the
held-out ones: other views of the photographs than those the held-out inputs show,
other noise, other token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from bladesmith.images import varied_photos

# How each held-out variant changes a test entry, in words for the report.
VARIANTS = (
    "other photographs, floats moved by a tenth of their spread, other token ids",
    "images mirrored with noise, floats reversed and moved, other token ids",
)
_SMALLEST_IMAGE = 16  # height and width from which a [.., 1 or 3, H, W] float is an image


@dataclass(frozen=True)
class HeldOut:
    """Held-out argument tuples, the index of the test entry each was derived from,
    and how they were made."""

    args: list[tuple]
    sources: list[int]
    how: str

    def __len__(self) -> int:
        return len(self.args)


def held_out_inputs(test_args: Sequence[tuple], count: int = len(VARIANTS)) -> HeldOut:
    """``count`` held-out variants of each test entry of a signature (structure, shapes,
    dtypes) that no earlier entry had; seeded, so every call gives the same. Variants
    past the two of ``VARIANTS`` are the first again with other seeds (other views of
    the photographs, other noise, other token ids): mirrored copies of one test input
    would be near copies of each other."""
    args, sources = _derived(
        test_args,
        count,
        lambda entry, index, variant: _variant(
            entry, variant if variant < len(VARIANTS) else 0, seed=1000 * index + variant
        ),
    )
    how = "; ".join(VARIANTS[:count])
    return HeldOut(args, sources, f"{len(args)} derived from the test data ({how})")


def items(test_args: Sequence[tuple]) -> int:
    """The items (images, rows) one held-out variant of each signature holds: its first
    argument's length (a list of images) or rows (a batch), one otherwise."""
    total = 0
    for _, entry in _first_of_each_signature(test_args):
        first = entry[0] if isinstance(entry, tuple) and entry else entry
        if isinstance(first, (list, tuple)):
            total += len(first)
        else:
            total += int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1
    return max(total, 1)


# Calibration inputs derived per test entry of a signature (each a batch like it).
CALIBRATION_VARIANTS = 8


def calibration_inputs(test_args: Sequence[tuple], count: int = CALIBRATION_VARIANTS) -> HeldOut:
    """``count`` calibration inputs per test entry of a new signature: as the held-out
    inputs' first variant (other photographs, moved floats, other token ids) but showing
    views after those the held-out inputs show, with other seeds."""
    args, sources = _derived(
        test_args,
        count,
        lambda entry, index, variant: _variant(
            entry, 0, seed=1_000_000 + 1000 * index + variant, skip=1 + variant
        ),
    )
    how = "other views of the photographs than the held-out inputs', floats moved by a "
    how += "tenth of their spread, other token ids"
    return HeldOut(args, sources, f"{len(args)} derived from the test data ({how})")


def _derived(test_args: Sequence[tuple], count: int, derive) -> tuple[list, list[int]]:
    """``count`` inputs ``derive(entry, index, variant)`` gives for each test entry of a
    signature (structure, shapes, dtypes) that no earlier entry had, and the index of the
    entry each came from."""
    args, sources = [], []
    for index, entry in _first_of_each_signature(test_args):
        for variant in range(count):
            args.append(derive(entry, index, variant))
            sources.append(index)
    return args, sources


def _first_of_each_signature(test_args: Sequence[tuple]):
    """(index, entry) of each test entry of a signature that no earlier entry had."""
    seen = set()
    for index, entry in enumerate(test_args):
        key = _signature(entry)
        if key not in seen:
            seen.add(key)
            yield index, entry


def source_of(entry, test_args: Sequence[tuple]) -> int | None:
    """The index of the first test entry of ``entry``'s signature (structure, shapes,
    dtypes); None where there is none."""
    key = _signature(entry)
    return next((i for i, each in enumerate(test_args) if _signature(each) == key), None)


def _signature(entry) -> tuple:
    leaves, spec = pytree.tree_flatten(entry)
    shapes = tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in leaves
    )
    return str(spec), shapes


def _variant(entry, variant: int, seed: int, skip: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return pytree.tree_map(lambda x: _changed(x, variant, generator, seed, skip), entry)


def _changed(value, variant: int, generator: torch.Generator, seed: int, skip: int = 0):
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return value
    if value.is_floating_point():
        high = _image_scale(value)
        if high is not None:
            return _other_image(value, high, variant, generator, seed, skip)
        return _moved(value, variant, generator)
    if value.dtype == torch.bool or value.is_complex():
        return value
    low, high = int(value.min()), int(value.max())
    if value.unique().numel() <= 2:  # masks, flags, lengths, type ids
        return value
    drawn = torch.randint(low, high + 1, value.shape, generator=generator)
    return drawn.to(device=value.device, dtype=value.dtype)


def _image_scale(value: torch.Tensor) -> float | None:
    """255 or 1, the top of an image's pixel range, when ``value`` looks like images;
    None otherwise."""
    if value.dim() < 3 or value.shape[-3] not in (1, 3):
        return None
    if min(value.shape[-2:]) < _SMALLEST_IMAGE:
        return None
    low, high = float(value.min()), float(value.max())
    if low < 0:
        return None
    return 1.0 if high <= 1.0 else 255.0 if high <= 255.0 else None


def _other_image(
    value: torch.Tensor,
    high: float,
    variant: int,
    generator: torch.Generator,
    seed: int,
    skip: int = 0,
) -> torch.Tensor:
    if variant % 2 == 1:  # mirrored, with noise of 2% of the range
        noise = torch.randn(value.shape, generator=generator) * 0.02 * high
        return (value.flip(-1) + noise.to(value)).clamp(0.0, high)
    count = value.numel() // value.shape[-3:].numel()
    # Views 1.. show the photographs after the astronaut (test data's usual first);
    # ``skip`` batches of them further on for calibration, never the held-out ones.
    first = 1 + skip * count
    stacked = varied_photos(first + count, tuple(value.shape[-2:]), seed=seed, first=first)
    if value.shape[-3] == 1:
        stacked = stacked.mean(-3, keepdim=True)
    return (stacked * high).reshape(value.shape).to(value)


def _moved(value: torch.Tensor, variant: int, generator: torch.Generator) -> torch.Tensor:
    spread = float(value.float().std()) if value.numel() > 1 else 0.0
    spread = spread or float(value.float().abs().max()) or 1.0
    noise = torch.randn(value.shape, generator=generator) * 0.1 * spread
    moved = value.flip(-1) if variant % 2 == 1 and value.dim() > 0 else value
    return moved + noise.to(value)
