"""Spec: what ``optimize`` produced, in a few fields (PAI-Blade returns one too).

It says where the optimized module runs (device, dtype), on what (the input shapes and
dtypes it was built and verified for), what it returns, which passes shaped it, the
tolerance its outputs were verified at, and the formats it saves in. ``save_formats`` are those
that were saved, loaded back and gave outputs within that tolerance during
``optimize``; ``untried_formats`` those too long to build then (``bladesmith.save``
builds them and checks them the same way); ``refused_formats`` the others, each with
why.
``to_dict()`` is JSON-ready.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# What the optimized module returns: its family's padded tensors, or the model's own
# structure (a family's ``user_output``, e.g. "detections", or whatever the model returned).
OUTPUT_PADDED = "padded"  # the family's padded tensors (a detector's boxes, scores, ...)
OUTPUT_AS_MODEL = "as the model"


@dataclass(frozen=True)
class Spec:
    device: str
    dtype: str  # the arithmetic's dtype; float outputs are returned as float32 regardless
    input_shapes: tuple[tuple[int, ...], ...]  # tensors the fast path was built for
    output: str  # OUTPUT_PADDED, the family's user_output, or OUTPUT_AS_MODEL
    passes: tuple[str, ...]  # kept, in the order they apply
    backend: str  # what runs: "eager" or the pass that built the runner
    save_formats: tuple[str, ...]  # suffixes saved, loaded and verified, the best first
    untried_formats: dict[str, str] = dataclasses.field(default_factory=dict)  # suffix: why
    refused_formats: dict[str, str] = dataclasses.field(default_factory=dict)  # suffix: why
    tolerance: dict = dataclasses.field(default_factory=dict)  # rtol, atol, why
    family: str | None = None  # the model's family (bladesmith.families), if one knew it
    # Each input's dtype, and an integer input's lowest and highest value in the test data
    # (None for the others): what a server takes and tests it with. Empty in artifacts
    # saved before they were recorded.
    input_dtypes: tuple[str, ...] = ()
    input_ranges: tuple[tuple[int, int] | None, ...] = ()
    # The model's output types (dataclasses, NamedTuples) as ``typed_outputs.record``
    # gives them, rebuilt on what runs; None where it returns plain containers.
    output_types: dict | None = None

    @classmethod
    def from_dict(cls, data: dict) -> Spec:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {name: value for name, value in data.items() if name in fields}
        values["input_shapes"] = tuple(tuple(shape) for shape in values["input_shapes"])
        values["passes"] = tuple(values["passes"])
        values["save_formats"] = tuple(values["save_formats"])
        values["input_dtypes"] = tuple(values.get("input_dtypes", ()))
        values["input_ranges"] = tuple(
            tuple(bounds) if bounds is not None else None
            for bounds in values.get("input_ranges", ())
        )
        return cls(**values)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["input_shapes"] = [list(shape) for shape in self.input_shapes]
        data["passes"] = list(self.passes)
        data["save_formats"] = list(self.save_formats)
        return data
