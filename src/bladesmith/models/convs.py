"""What rewrites of convolution layers check before they touch one."""

from __future__ import annotations

from torch import nn


def is_same_size_3x3(module: nn.Module) -> bool:
    """A plain nn.Conv2d, 3x3, stride 1, zero padding 1, no dilation or groups: its output
    has its input's size, and every output sees exactly the 3x3 window around it."""
    return (
        type(module) is nn.Conv2d
        and module.kernel_size == (3, 3)
        and module.stride == (1, 1)
        and module.padding == (1, 1)
        and module.dilation == (1, 1)
        and module.groups == 1
        and module.padding_mode == "zeros"
    )
