"""The pass registry: what a pass is, and the ordered list of those that exist.

A pass is a small class: ``name``, the ``levels`` that include it, the ``devices``
(kinds: "cuda", "cpu", ...) it runs on, an optional ``skip_reason`` for candidates it
does not apply to, and ``apply(candidate, context) -> candidate``. ``apply`` returns a
new candidate and leaves the one it was given untouched (the engine may keep it). It
raises ``PassSkipped`` when it finds out late that it does not apply (a dependency is
missing); any other exception marks the pass failed. The engine verifies and times the
result; passes never judge themselves.

Passes run in registration order: the built-in ones in ``bladesmith.passes.ORDER``,
then any registered later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from bladesmith.config import LEVELS, Config
from bladesmith.passes.candidate import Candidate
from bladesmith.verify.precisions import Precision


class PassSkipped(Exception):
    """The pass does not apply here; the message says why (it goes in the report)."""


@dataclass
class Context:
    """What a pass may know about the run beyond its candidate."""

    device: torch.device
    level: str
    config: Config
    example_args: tuple  # the first test input, as the user calls the model, on device
    test_args: list[tuple] = field(default_factory=list)  # every test input, the same way
    kept: list[str] = field(default_factory=list)  # passes kept so far, in order
    notes: list[str] = field(default_factory=list)  # diagnosis lines passes add
    # The user's own operators the model calls ("myops::scale_clip"; ops/libraries.py)
    user_operators: frozenset[str] = frozenset()
    # calibration() -> (inputs a quantizing pass calibrates on, as the user calls the
    # model, never the held-out ones; what they are, for the report), made on first use
    calibration: Callable[[], tuple[list[tuple], str]] = lambda: ([], "none")
    # step(description) -> context manager that shows progress during a long step
    step: Callable[[str], contextlib.AbstractContextManager] = lambda _: contextlib.nullcontext()

    def calibration_calls(self, candidate: Candidate) -> tuple[list[tuple], str]:
        """The calibration inputs as ``candidate``'s runner takes them, and what they are;
        ``PassSkipped`` where there are none."""
        calibration, how = self.calibration()
        if not calibration:
            raise PassSkipped("no calibration inputs (Config.calibration_data)")
        return [candidate.runner_args(each) for each in calibration], how


class Pass:
    """Base of every pass. Subclasses set the class attributes and ``apply``."""

    name: ClassVar[str]
    levels: ClassVar[tuple[str, ...]] = LEVELS
    devices: ClassVar[tuple[str, ...]] = ("cuda", "cpu")
    # Passes that change numerical precision are the ones the accuracy-check waiver
    # (Config.disable_fp16_accuracy_check) applies to.
    changes_precision: ClassVar[bool] = False
    # The precision a precision pass's result computes in (``verify.precisions``): how it
    # is judged, and what Spec.dtype says. A result in it is not saved in the
    # ``refuses_formats`` of the passes that compute in it, whichever of them it kept:
    # the engine asks the passes, never names them.
    computes_in: ClassVar[Precision | None] = None
    # An enabler is kept when accurate even if it is not faster by itself, because the
    # passes after it need what it does (fixed shapes for compilation and CUDA graphs).
    # If nothing after it pays off, the engine falls back to the fastest result.
    enabler: ClassVar[bool] = False
    # A finisher wraps what runs without changing what it computes (a CUDA graph around
    # it). The engine times the candidates before it wrapped by it, as they will run, so
    # a pass that pays off only there (fp16 at batch 1, where eager launches dominate)
    # is judged by what it is worth in the end.
    finisher: ClassVar[bool] = False
    # Whether the pass's result computes otherwise than its input (another dtype,
    # summation order, kernel or algorithm): such a pass can only be kept on outputs that
    # verify it, not on a model whose own answer rounding alone changes (unless
    # Config(allow_unverified=True)). False for a pass that runs the same kernels as
    # they are (a CUDA graph replaying them).
    changes_arithmetic: ClassVar[bool] = True
    # A pass that rewrites the module's layers; a TorchScript module cannot be rewritten,
    # so the engine skips it there.
    rewrites_modules: ClassVar[bool] = False
    # The save format (a suffix of ``runtimes.formats.FORMATS``) whose file holds what this pass's
    # runner runs; when the pass builds the result's runner, that format is listed first.
    saves_as: ClassVar[str | None] = None
    # Save formats that would not run what this pass built, each with why: a result that
    # kept the pass refuses them rather than save something slower than what was measured
    # or something that does not run; with Config(save_as=...) one of them, the pass is
    # skipped.
    refuses_formats: ClassVar[dict[str, str]] = {}
    # Save formats that hold the result without this pass's gain, each with why (they
    # run what it replaced): the result is saved in them, and the report says, where the
    # artifact is one, that it loses the gain and which format keeps it.
    lost_in: ClassVar[dict[str, str]] = {}

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        """Why this pass does not apply to ``candidate``, or None when it does."""
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        raise NotImplementedError(f"pass {self.name} does not implement apply()")

    def saving_form(self, candidate: Candidate, context: Context) -> Candidate | None:
        """``candidate`` in a form that computes the same outputs and saves in formats
        it does not save in itself (a detector's fixed-shape pipeline, which traces where
        the module's list of detections does not), or None: the engine saves through it
        a result this pass was not kept on."""
        return None

    @classmethod
    def summary(cls) -> str:
        """The first line of the pass's docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Add a pass to the registry, after those registered before it (a class decorator
    too)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__}: a pass needs a non-empty string `name`")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"a pass named {name!r} is already registered ({_REGISTRY[name]})")
    unknown = set(cls.levels) - set(LEVELS)
    if unknown:
        raise ValueError(f"pass {name}: unknown levels {sorted(unknown)}; levels are {LEVELS}")
    _REGISTRY[name] = cls
    return cls


def names() -> list[str]:
    """Every registered pass's name, in the order passes run."""
    _load_builtin_passes()
    return list(_REGISTRY)


def create_all() -> list[Pass]:
    """A fresh instance of every registered pass, in order."""
    _load_builtin_passes()
    return [cls() for cls in _REGISTRY.values()]


def describe() -> Iterator[tuple[str, tuple[str, ...], tuple[str, ...], str]]:
    """(name, levels, devices, summary) of every registered pass, in order."""
    _load_builtin_passes()
    for name, cls in _REGISTRY.items():
        yield name, cls.levels, cls.devices, cls.summary()


def _load_builtin_passes() -> None:
    import bladesmith.passes  # noqa: F401  (registers the built-in passes, in ORDER)
