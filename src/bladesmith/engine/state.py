"""Whether calling a model changes its own parameters or buffers (``self.count += 1``,
batch norm statistics updated in training mode): such a model's outputs depend on how
often it ran, so no run of it can be a reference for another, nor be timed as the same
work. The engine checks it around the model's first runs."""

from __future__ import annotations

import torch
from torch import nn


def fingerprint(module: nn.Module) -> dict[str, tuple]:
    """Each parameter's and buffer's shape, dtype and a checksum of its values: cheap (one
    sum per tensor, no copy), and blind to the tensors being replaced by equal ones
    (``self.anchors = self.anchors.to(device)`` changes nothing that matters)."""
    tensors = {f"parameter {name!r}": p for name, p in module.named_parameters()}
    tensors.update({f"buffer {name!r}": b for name, b in module.named_buffers()})
    return {name: _summary(tensor) for name, tensor in tensors.items()}


def _summary(tensor: torch.Tensor) -> tuple:
    with torch.no_grad():
        data = tensor.detach()
        if data.is_complex():
            data = torch.view_as_real(data)
        try:
            total = float(data.sum(dtype=torch.float64)).hex()  # NaN equals NaN as text
        except (RuntimeError, TypeError):  # meta, quantized, sparse...: shape and dtype only
            total = None
    return tuple(tensor.shape), tensor.dtype, total


def changed(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """The parameters and buffers that differ (or came or went) between two fingerprints."""
    return sorted(
        name for name in before.keys() | after.keys() if before.get(name) != after.get(name)
    )
