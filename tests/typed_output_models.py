"""Small models returning the output types users' models return: a dataclass, a
NamedTuple, and ``ModelOutput``, a minimal copy of ``transformers.utils.ModelOutput``'s
form (an OrderedDict subclass that is also a dataclass and holds only the fields that
are not None). Its own module, so that a new process can import it by name."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import torch
from torch import nn


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    hidden: torch.Tensor


class Pair(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


@dataclasses.dataclass
class ModelOutput(collections.OrderedDict):
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    attentions: torch.Tensor | None = None  # left None: not an entry

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


class Net(nn.Module):
    """A linear layer whose outputs go out as ``output_type`` (a class, called with the
    fields as keywords)."""

    def __init__(self, output_type):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 4)
        self.output_type = output_type

    def forward(self, x):
        logits = self.linear(x)
        return self.output_type(logits=logits, hidden=logits.relu())
