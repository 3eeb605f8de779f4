"""The models the commands take: a built-in model by name, or a model file.

Built-in models are ``models.catalog``'s (torchvision's, random weights or ``--weights``,
a local state-dict file); a file is TorchScript (.pt) or a torch.export program (.pt2),
loaded by the engine's loader, the one ``optimize`` uses for a path.
"""

from __future__ import annotations

from bladesmith.cli.args import batches_said
from bladesmith.models.catalog import CATALOG, DEFAULT

DEFAULT_MODEL = DEFAULT  # what the commands take when no model is named
MODEL_HELP = f"{' or '.join(CATALOG)}, or a .pt/.pt2 file"


def model_or_file(name: str, input_size: tuple[int, int], weights=None, num_classes: int = 91):
    """The built-in model ``name``, built for ``input_size``, or the path ``name`` of a
    model file, checked to exist."""
    from bladesmith._files import unreadable
    from bladesmith.errors import BladesmithError

    if name in CATALOG:
        from bladesmith.models.catalog import build

        return build(name, input_size, weights, num_classes)
    if weights:
        raise BladesmithError("--weights applies to the built-in models, not to model files")
    problem = unreadable(name)
    if problem:
        raise BladesmithError(
            f"model {name!r}: {problem}; expected a built-in model ({', '.join(CATALOG)}) "
            "or a .pt/.pt2 file"
        )
    return name


def load_model(
    name: str, input_size: tuple[int, int], weights=None, num_classes: int = 91, trust=False
):
    """``model_or_file``, a file loaded as a module in eval mode (``trust``: see
    ``load_model_file``)."""
    from bladesmith.engine import load_model_file
    from bladesmith.runtimes.torchscript import in_eval_mode

    model = model_or_file(name, input_size, weights, num_classes)
    if isinstance(model, str):
        model = load_model_file(model, trust=trust)
    return in_eval_mode(model)


def image_flags_advice(args) -> str:
    """What to change when a model file fails on the images it was given: --input-size
    and --batch."""
    height, width = args.input_size
    return (
        f"give --input-size (now {height}x{width}) and --batch (now "
        f"{batches_said(args.batch)}) that the "
        "model takes (it gets RGB images; other inputs: from Python)"
    )
