"""The model families bladesmith knows (``base.Family``: recognise, adapt to a fixed-shape
pipeline, turn outputs back, compare).

A new family is one module defining ``FAMILY`` plus one line in ``FAMILIES``.
"""

from __future__ import annotations

from bladesmith.errors import BladesmithError
from bladesmith.families import retinanet
from bladesmith.families.base import DetectionFamily, Family

FAMILIES: list[Family] = [
    retinanet.FAMILY,
]


def family_of(model) -> Family | None:
    """The family that recognises ``model``, or None."""
    return next((family for family in FAMILIES if family.detects(model)), None)


def family_named(name: str) -> Family:
    """The family called ``name`` (as artifacts and specs record it)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    known = ", ".join(family.name for family in FAMILIES)
    raise BladesmithError(
        f"no model family named {name!r} is registered (known: {known}); import the module "
        "that defines it and add its FAMILY to bladesmith.families.FAMILIES first"
    )


__all__ = ["FAMILIES", "DetectionFamily", "Family", "family_of", "family_named"]
