"""Candidate: one version of the model that passes transform and the engine measures.

A candidate has two forms. ``module`` is the eager ``nn.Module`` that passes rewrite
(change its dtype, memory format, swap a detector's post-processing); it is never the
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

from bladesmith.models.images import as_batch


@dataclass(frozen=True)
class Candidate:
    module: nn.Module
    device: torch.device
    dtype: torch.dtype = torch.float32  # what floating-point arithmetic runs in
    runner: Callable | None = None
    # The runner takes one batch [B, 3, H, W] and returns padded detections (boxes,
    # scores, labels, num_detections); users get torchvision's list of dicts.
    padded_detections: bool = False
    module_passes: tuple[str, ...] = ()  # passes that shaped the module, in order
    runner_passes: tuple[str, ...] = ()  # passes that built the runner, in order

    @property
    def applied(self) -> tuple[str, ...]:
        return self.module_passes + self.runner_passes

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
        if not self.padded_detections:
            return tuple(user_args)
        return (as_batch(user_args[0]),)

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
