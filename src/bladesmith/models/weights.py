"""A state dict the user names, loaded into a model: a training checkpoint that wraps it
under a common key is unwrapped, and a file that is not a state dict for this model
raises one line saying what the file is, or a summary of the mismatch (not every key)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from bladesmith._files import contents, first_line, unreadable
from bladesmith.errors import BladesmithError, MissingFileError

# Where training scripts keep the weights in a checkpoint: {"model": ..., "epoch": 3}.
CHECKPOINT_KEYS = ("model", "state_dict", "model_state_dict", "net", "weights")
_EXAMPLES = 3  # keys named in a mismatch summary


def load_weights(model: nn.Module, path: str | os.PathLike, flag: str = "weights") -> None:
    """Load the state dict in ``path`` into ``model``, exactly (every key, every shape);
    an error names ``flag`` (the argument or option that gave the path) and the file."""
    state, where = read_state_dict(path, flag)
    expected = model.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    reshaped = [
        f"{key} {list(state[key].shape)} for {list(value.shape)}"
        for key, value in expected.items()
        if key in state and tuple(state[key].shape) != tuple(value.shape)
    ]
    if missing or unexpected or reshaped:
        matched = len(expected) - len(missing) - len(reshaped)
        parts = [
            f"{len(items)} {label} (e.g. {', '.join(items[:_EXAMPLES])})"
            for label, items in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("of another shape", reshaped),
            )
            if items
        ]
        raise BladesmithError(
            f"{flag} {str(path)!r}{where}: a state dict for another model: {matched} of "
            f"the {len(expected)} entries {type(model).__name__} needs fit; "
            f"{'; '.join(parts)}. Give the weights of this architecture"
        )
    model.load_state_dict(state)


def read_state_dict(
    path: str | os.PathLike, flag: str = "weights"
) -> tuple[dict[str, torch.Tensor], str]:
    """(the state dict in ``path``, " (under 'key')" when a checkpoint wrapped it, else "")."""
    path = os.fspath(path)
    problem = unreadable(path)
    if problem:
        error = MissingFileError if not os.path.exists(path) else BladesmithError
        raise error(f"{flag} {path!r}: {problem}")
    try:
        with warnings.catch_warnings():  # the error says it all; no second line
            warnings.simplefilter("ignore")
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and torch errors alike
        what = contents(path)
        hint = "save one with torch.save(model.state_dict(), path)"
        if what == "a TorchScript model":
            hint = "give a model file as the model itself, or save its state_dict()"
        raise BladesmithError(
            f"{flag} {path!r}: not a state dict but {what} ({first_line(error)}); {hint}"
        ) from error
    where = ""
    if isinstance(loaded, Mapping):
        for key in CHECKPOINT_KEYS:
            if isinstance(loaded.get(key), Mapping):
                loaded, where = loaded[key], f" (under {key!r})"
                break
    if not isinstance(loaded, Mapping) or not all(
        isinstance(value, torch.Tensor) for value in loaded.values()
    ):
        kind = type(loaded).__name__
        raise BladesmithError(
            f"{flag} {path!r}{where}: a {kind}, not a state dict (a dict of tensors, or a "
            f"checkpoint holding one under {', '.join(map(repr, CHECKPOINT_KEYS))})"
        )
    return dict(loaded), where
