"""What a saved runner takes, checked at every call.

An AOTInductor package runs any input as the shapes and dtypes it was compiled for (it
checks them only under AOTI_RUNTIME_CHECK_INPUTS=1), and a trace can keep its example's
batch (``if x.size(0) > 1:`` is recorded as the branch the example took): either answers
a call of another shape with rows read past the input, or computed for another batch.
A loaded artifact therefore runs what it was built for and refuses anything else in one
line (``Checked``). What it was built for (``BuiltFor``) is its spec's input shapes and
dtypes and whether its batch is free, which its metadata records; a ``.pt2`` holds one
model per input signature of the test data. The result of ``optimize`` that runs a trace
keeping its example's batch refuses other inputs too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.utils import _pytree as pytree

from bladesmith.errors import BladesmithError
from bladesmith.onnx.sessions import given_argument, holds_argument


def tensors_in(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def signature(tree) -> tuple[tuple[tuple[int, ...], str], ...]:
    """The shape and dtype of each tensor in ``tree``."""
    return tuple((tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in tensors_in(tree))


@dataclass(frozen=True)
class BuiltFor:
    """The tensor inputs a runner was built for: their shapes and dtypes (a spec's
    ``input_shapes`` and ``input_dtypes``), and whether the first dimension of each may
    take any size (checked: ``follows_the_batch``); ``why`` others are refused."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    free_batch: bool
    why: str
    # Only the batch is held (a runner verified at several sizes of the test data, which
    # the spec, describing the first, does not list).
    batch_only: bool = False
    # The non-tensor arguments it holds as constants, as JSON of ``onnx.exporter.
    # baked_arguments``' entries: a .pt2's model answers as if given those values.
    constants: str = ""

    @cached_property
    def constant_arguments(self) -> list[dict]:
        """``constants``' entries."""
        return json.loads(self.constants) if self.constants else []

    def holds(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call gives the non-tensor arguments the values it holds."""
        return all(holds_argument(entry, args, kwargs) for entry in self.constant_arguments)

    def given(self, args: tuple, kwargs: dict) -> list[str]:
        """What a call gives for the arguments it holds, as "name=value"."""
        return [given_argument(entry, args, kwargs) for entry in self.constant_arguments]

    @classmethod
    def of(cls, spec, *, free_batch: bool, why: str, batch_only: bool = False) -> BuiltFor | None:
        """What ``spec``'s inputs are; None for a spec that does not record their dtypes
        (an artifact saved before it did)."""
        if len(spec.input_dtypes) != len(spec.input_shapes):
            return None
        free = free_batch and all(spec.input_shapes)
        return cls(spec.input_shapes, spec.input_dtypes, free, why, batch_only and not free)

    def fits(self, shape: tuple[int, ...], built: tuple[int, ...]) -> bool:
        if self.free_batch and len(shape) == len(built) and shape:
            return shape[1:] == built[1:]
        if self.batch_only and len(shape) == len(built) and shape:
            return shape[0] == built[0]
        return shape == built

    def takes(self, got: tuple[tuple[tuple[int, ...], str], ...]) -> bool:
        """Whether it runs tensors of the shapes and dtypes ``got`` (a ``signature``)."""
        return len(got) == len(self.shapes) and all(
            self.fits(shape, built) and dtype == want
            for (shape, dtype), built, want in zip(got, self.shapes, self.dtypes)
        )

    def describe(self) -> str:
        shapes = [  # B: any batch; *: any size
            ("B", *shape[1:])
            if self.free_batch
            else (shape[0], *"*" * (len(shape) - 1))
            if self.batch_only and shape
            else shape
            for shape in self.shapes
        ]
        held = [f"{entry['name']}={entry['repr']}" for entry in self.constant_arguments]
        return ", ".join([describe_tensors(list(zip(shapes, self.dtypes))), *held])


def one_per_signature(calls: list[tuple]) -> list[tuple]:
    """The first of ``calls`` of each input signature (shapes and dtypes, and the
    non-tensor arguments, which a .pt2's model holds as constants), in order."""
    firsts = {}
    for args in calls:
        constants = [repr(leaf) for leaf in pytree.tree_leaves(args) if not torch.is_tensor(leaf)]
        firsts.setdefault((signature(args), *constants), args)
    return list(firsts.values())


def describe_tensors(tensors) -> str:
    """(shape, dtype) pairs (a ``signature``) as ``[1, 3, 8, 8] float32, [1] int64``."""
    if not tensors:
        return "no tensor"
    return ", ".join(f"[{', '.join(map(str, shape))}] {dtype}" for shape, dtype in tensors)


class Checked:
    """The runner of ``runs`` ({BuiltFor: runner}: one, or a ``.pt2``'s model per input
    signature) built for a call's inputs, refusing in one line (naming ``source``) a
    call that none of them was built for."""

    def __init__(self, runs: dict[BuiltFor, Callable], source: str):
        self.runs = runs
        self.source = source

    def __call__(self, *args, **kwargs):
        got = signature((args, kwargs))
        run = next(
            (
                run
                for built, run in self.runs.items()
                if built.takes(got) and built.holds(args, kwargs)
            ),
            None,
        )
        if run is None:
            raise BladesmithError(f"{self.source}: {self._refusal(got, args, kwargs)}")
        return run(*args, **kwargs)

    def _refusal(self, got, args: tuple, kwargs: dict) -> str:
        built = list(self.runs)
        several = len(built) > 1  # parenthesised where one holds several inputs
        runs = " or ".join(
            f"({each.describe()})"
            if several and len(each.shapes) + len(each.constant_arguments) > 1
            else each.describe()
            for each in built
        )
        given = ", ".join([describe_tensors(got), *built[0].given(args, kwargs)])
        return (
            f"got {given}, but it runs {runs} only ({built[0].why}): "
            "pass inputs like those, or optimize again with test data like yours"
        )


def follows_the_batch(runner: Callable, module, args: tuple) -> bool:
    """Whether ``runner`` gives ``module``'s outputs at other batch sizes than
    ``args``'s: twice its items (then the same in reverse order) and, where it has more
    than one, its first item alone. Same structure and shapes, values within four times
    the rounding that separates the two at ``args``'s own batch (their dtype's, bfloat16's
    too), and at least 1e-3 of each output's largest value: far tighter than what a graph
    that kept its example's batch gives (it fails, repeats the wrong items, or took
    another branch)."""
    own = _outputs(runner, module, args)
    if own is None:
        return False
    rounding = [_deviation(want, have) for want, have in zip(*own, strict=True)]
    batches = [_rows(args, lambda x: torch.cat([x, x.flip(0)]))]
    tensors = tensors_in(args)
    if tensors and all(x.dim() and x.shape[0] > 1 for x in tensors):
        batches.append(_rows(args, lambda x: x[:1]))
    return all(_same_outputs(runner, module, batch, rounding) for batch in batches)


def _rows(args: tuple, change) -> tuple:
    return pytree.tree_map(
        lambda x: change(x) if isinstance(x, torch.Tensor) and x.dim() else x, args
    )


def _outputs(runner: Callable, module, args: tuple) -> tuple[list, list] | None:
    """``module``'s and ``runner``'s flat outputs on ``args``; None where the runner
    refuses them (its build fixed their shape) or returns another structure."""
    try:
        with torch.no_grad():
            expected, structure = pytree.tree_flatten(module(*args))
            got, got_structure = pytree.tree_flatten(runner(*args))
    except Exception:
        return None
    return (expected, got) if structure == got_structure else None


def _deviation(want, have) -> float:
    """The largest difference between two float tensors of one shape, else 0."""
    if not (isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor)):
        return 0.0
    if not want.is_floating_point() or want.shape != have.shape or not want.numel():
        return 0.0
    return (have.to(want) - want).abs().max().item()


def _same_outputs(runner: Callable, module, args: tuple, rounding: list[float]) -> bool:
    found = _outputs(runner, module, args)
    return found is not None and all(
        _close(want, have, 4 * allowed) for want, have, allowed in zip(*found, rounding)
    )


def _close(want, have, allowed: float) -> bool:
    if not isinstance(want, torch.Tensor):
        return want == have
    if not isinstance(have, torch.Tensor) or want.shape != have.shape:
        return False
    have = have.to(want)
    if not want.is_floating_point():
        return torch.equal(have, want)
    scale = want.abs().max().item() if want.numel() else 0.0
    return torch.allclose(have, want, rtol=1e-3, atol=max(1e-3 * scale, allowed))
