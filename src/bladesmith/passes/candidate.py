"""Candidate: one version of the model that passes transform and the engine measures.

A candidate has two forms. ``module`` is the eager ``nn.Module`` that passes rewrite
(change its dtype, memory format, adapt it to its family's fixed-shape pipeline); it is never the
user's model. ``runner`` is what runs, when a pass built one from the module (a
compiled function, a frozen TorchScript module, an ONNX Runtime session, a CUDA graph);
None means the module runs as is. A pass that rewrites the module drops the runner: a
compiled or captured form would be stale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bladesmith.families.base import Family
from bladesmith.verify import precisions
from bladesmith.verify.precisions import Precision


@dataclass(frozen=True)
class Candidate:
    module: nn.Module
    device: torch.device
    dtype: torch.dtype = torch.float32  # what floating-point arithmetic runs in
    runner: Callable | None = None
    # The family whose fixed-shape pipeline the module is (None: the model's own form):
    # the runner takes the family's pipeline inputs and returns its padded outputs,
    # which users get back in the model's structure (Family.to_user).
    family: Family | None = None
    module_passes: tuple[str, ...] = ()  # passes that shaped the module, in order
    runner_passes: tuple[str, ...] = ()  # passes that built the runner, in order
    # The precision a pass declared where ``dtype`` cannot say it (int8 kernels take and
    # return float32); None: ``dtype``'s own.
    precision: Precision | None = None

    @property
    def applied(self) -> tuple[str, ...]:
        return self.module_passes + self.runner_passes

    @property
    def computes_in(self) -> Precision:
        """The precision the candidate computes in, which says how it is judged."""
        return self.precision or precisions.of_dtype(self.dtype)

    @property
    def backend(self) -> str:
        """What runs: "eager", or the pass that built the runner."""
        return self.runner_passes[0] if self.runner_passes else "eager"

    def __call__(self, *args, **kwargs):
        """Run the fast form on runner-form inputs (see ``runner_args``)."""
        run = self.runner if self.runner is not None else self.module
        return run(*args, **kwargs)

    def runner_args(self, user_args: tuple) -> tuple:
        """The runner's inputs for the user's call ``model(*user_args)``."""
        if self.family is None:
            return tuple(user_args)
        return self.family.pipeline_args(user_args)

    def with_module(self, module: nn.Module, name: str, **changes) -> Candidate:
        """A candidate whose module is ``module``, shaped by pass ``name``; no runner."""
        return dataclasses.replace(
            self,
            module=module,
            runner=None,
            runner_passes=(),
            module_passes=(*self.module_passes, name),
            **changes,
        )

    def with_runner(self, runner: Callable, name: str, wraps: bool = False) -> Candidate:
        """A candidate that runs ``runner``, built by pass ``name``: from the module
        (replacing any runner so far), or, with ``wraps``, around the current runner."""
        passes = (*self.runner_passes, name) if wraps else (name,)
        return dataclasses.replace(self, runner=runner, runner_passes=passes)
