"""What makes a comparison compare nothing: non-finite inputs or reference outputs, no
output, or outputs that hold nothing (empty, all zero, no detection). Such a comparison
is a diagnosis, not a pass."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch.utils import _pytree as pytree

from bladesmith.verify.detections import is_detection_list

# Leaves compared as tensors (bool is an int; numpy scalars are np.generic).
TENSOR_LIKE = (torch.Tensor, np.ndarray, np.generic, int, float, complex)


def degenerate_reasons(reference, inputs=None, name: str = "out") -> list[str]:
    """Why comparing with ``reference`` would compare nothing: NaN or inf in ``inputs``
    or in the reference, no output at all, or no output that holds anything (every
    tensor empty or zero, no detection in any image)."""
    reasons = []
    for label, tree in (("input", inputs), ("reference output", reference)):
        tensors = [torch.as_tensor(x) for x in _leaves(tree)]
        bad = sum(int((~torch.isfinite(t)).sum()) for t in tensors if t.is_floating_point())
        if bad:
            total = sum(t.numel() for t in tensors)
            reasons.append(f"{bad} of {total} {label} values are NaN or inf")
    holders = [_holds_something(value) for value in _outputs_of(reference)]
    if not holders:
        reasons.append(f"{name}: the model returns no tensor and no detection")
    elif not any(holders):
        reasons.append(f"{name}: every reference output is empty or zero, or has no detection")
    return reasons


def _leaves(tree) -> list:
    if tree is None:
        return []
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, TENSOR_LIKE)]


def _outputs_of(tree) -> list:
    """The outputs compared one by one: detection lists whole, tensors."""
    if is_detection_list(tree):
        return [tree]
    if isinstance(tree, Mapping):
        return [x for value in tree.values() for x in _outputs_of(value)]
    if isinstance(tree, (list, tuple)):
        return [x for value in tree for x in _outputs_of(value)]
    return [tree] if isinstance(tree, TENSOR_LIKE) else []


def _holds_something(output) -> bool:
    if is_detection_list(output):
        return any(len(image["scores"]) for image in output)
    tensor = torch.as_tensor(output)
    return tensor.numel() > 0 and bool((tensor != 0).any())
