"""The models the commands take: a built-in model by name, or a model file.

Built-in models are torchvision's, built here with random weights (or ``--weights``, a
local state-dict file); a file is TorchScript (.pt) or a torch.export program (.pt2),
loaded by the engine's loader, the one ``optimize`` uses for a path.
"""

from __future__ import annotations

BUILTIN_MODELS = {
    # name -> build_retinanet(backbone=...)
    "torchvision:retinanet_resnet50_fpn": "resnet50",
    "torchvision:retinanet_resnet18_fpn": "resnet18",  # same detector, a lighter backbone
}
DEFAULT_MODEL = "torchvision:retinanet_resnet50_fpn"
MODEL_HELP = f"{' or '.join(BUILTIN_MODELS)}, or a .pt/.pt2 file"


def model_or_file(name: str, input_size: tuple[int, int], weights=None, num_classes: int = 91):
    """The built-in model ``name``, built for ``input_size``, or the path ``name`` of a
    model file, checked to exist."""
    from pathlib import Path

    from bladesmith.errors import BladesmithError

    if name in BUILTIN_MODELS:
        from bladesmith.models.builtin import build_retinanet

        return build_retinanet(
            input_size, weights=weights, num_classes=num_classes, backbone=BUILTIN_MODELS[name]
        )
    if weights:
        raise BladesmithError("--weights applies to the built-in models, not to model files")
    if not Path(name).is_file():
        raise BladesmithError(
            f"model {name!r}: neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor an existing .pt/.pt2 file"
        )
    return name


def load_model(name: str, input_size: tuple[int, int], weights=None, num_classes: int = 91):
    """``model_or_file``, a file loaded as a module in eval mode."""
    import contextlib

    from bladesmith.engine import load_model_file

    model = model_or_file(name, input_size, weights, num_classes)
    if isinstance(model, str):
        model = load_model_file(model)
    with contextlib.suppress(NotImplementedError):  # exported modules refuse eval()
        model.eval()
    return model
