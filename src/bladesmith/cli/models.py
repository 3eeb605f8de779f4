"""The models the commands take: a built-in model by name, or a model file.

Built-in models are torchvision's, built here with random weights (or ``--weights``, a
local state-dict file); a file is TorchScript (.pt) or a torch.export program (.pt2),
loaded by the engine's loader, the one ``optimize`` uses for a path.
"""

from __future__ import annotations

from bladesmith.cli.args import batches_said

BUILTIN_MODELS = {
    # name -> build_retinanet(backbone=...)
    "torchvision:retinanet_resnet50_fpn": "resnet50",
    "torchvision:retinanet_resnet18_fpn": "resnet18",  # same detector, a lighter backbone
    "torchvision:retinanet_resnet50_fpn_v2": "resnet50_v2",
}
# The other torchvision detectors: name -> (families module, variant). Random weights
# calibrated to a trained model's load (see each module's builder), or --weights.
DETECTORS = {
    "torchvision:fcos_resnet50_fpn": ("fcos", "resnet50"),
    "torchvision:ssd300_vgg16": ("ssd", "ssd300_vgg16"),
    "torchvision:ssdlite320_mobilenet_v3_large": ("ssd", "ssdlite320_mobilenet_v3_large"),
    **{
        f"torchvision:{variant}": ("rcnn", variant)
        for variant in (
            "fasterrcnn_resnet50_fpn",
            "fasterrcnn_resnet50_fpn_v2",
            "fasterrcnn_mobilenet_v3_large_fpn",
            "fasterrcnn_mobilenet_v3_large_320_fpn",
            "maskrcnn_resnet50_fpn",
            "maskrcnn_resnet50_fpn_v2",
        )
    },
}
DEFAULT_MODEL = "torchvision:retinanet_resnet50_fpn"
MODEL_HELP = f"{' or '.join([*BUILTIN_MODELS, *DETECTORS])}, or a .pt/.pt2 file"


def model_or_file(name: str, input_size: tuple[int, int], weights=None, num_classes: int = 91):
    """The built-in model ``name``, built for ``input_size``, or the path ``name`` of a
    model file, checked to exist."""
    from bladesmith._files import unreadable
    from bladesmith.errors import BladesmithError

    if name in BUILTIN_MODELS:
        from bladesmith.models.builtin import build_retinanet

        return build_retinanet(
            input_size, weights=weights, num_classes=num_classes, backbone=BUILTIN_MODELS[name]
        )
    if name in DETECTORS:
        return build_detector(name, input_size, weights, num_classes)
    if weights:
        raise BladesmithError("--weights applies to the built-in models, not to model files")
    problem = unreadable(name)
    if problem:
        builtin = ", ".join([*BUILTIN_MODELS, *DETECTORS])
        raise BladesmithError(
            f"model {name!r}: {problem}; expected a built-in model ({builtin}) or a .pt/.pt2 file"
        )
    return name


def build_detector(name: str, input_size: tuple[int, int], weights=None, num_classes: int = 91):
    """The built-in detector ``name`` (a key of ``DETECTORS``) for ``input_size``."""
    from pathlib import Path

    import torch

    from bladesmith.families import fcos, rcnn, ssd

    module, variant = DETECTORS[name]
    realistic = weights is None
    if module == "fcos":
        model = fcos.build_fcos(input_size, realistic, num_classes, backbone=variant)
    elif module == "ssd":  # SSD resizes every image to its own size
        model = ssd.build_ssd(variant, realistic, num_classes)
    else:
        model = rcnn.build_rcnn(variant, input_size, realistic, num_classes)
    if weights is not None:
        model.load_state_dict(torch.load(Path(weights), map_location="cpu", weights_only=True))
    return model


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
