"""What a module's layers are handed: a pass that sizes or scales a layer by its inputs
(Winograd's input sizes, FP8's calibrated ranges) runs the model once with a look at
each layer's arguments."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def watch_inputs(
    module: nn.Module,
    layers: Iterable[nn.Module],
    calls: Iterable[tuple],
    record: Callable[[nn.Module, tuple], None],
) -> None:
    """Run ``module`` on each of ``calls`` without gradients, with ``record(layer, args)``
    called as each of ``layers`` is about to run; the module is left as it was."""
    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        with torch.no_grad():
            for args in calls:
                module(*args)
    finally:
        for hook in hooks:
            hook.remove()
