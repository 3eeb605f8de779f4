"""The built-in models: the one list of them (``CATALOG``, each built by its family's
builder in ``bladesmith.families``) and the one loader of a state-dict file for all of
them (``build``'s ``weights``: a checkpoint unwrapped, a wrong file one line naming it).

Importing this module imports no torch: the command line lists the names in its help.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BuiltIn:
    """A built-in model: ``bladesmith.families.<family>.build_<family>(**options)``."""

    family: str  # the module of bladesmith.families whose builder makes it
    options: dict[str, str] = field(default_factory=dict)  # its variant= or backbone=
    sized: bool = True  # built for the image size; False: it resizes every image itself

    def build(self, image_size, num_classes: int, realistic_load: bool = True, seed: int = 0):
        """The model with seeded random weights, in eval mode, by its family's builder
        (``realistic_load``: calibrated to a trained model's load)."""
        family = importlib.import_module(f"bladesmith.families.{self.family}")
        sizes = {"image_size": image_size} if self.sized else {}
        return getattr(family, f"build_{self.family}")(
            realistic_load=realistic_load,
            num_classes=num_classes,
            seed=seed,
            **sizes,
            **self.options,
        )


def _torchvision(family: str, *variants: str, sized: bool = True) -> dict[str, BuiltIn]:
    """torchvision's builders ``variants`` by their own names."""
    return {
        f"torchvision:{variant}": BuiltIn(family, {"variant": variant}, sized)
        for variant in variants
    }


CATALOG: dict[str, BuiltIn] = {
    "torchvision:retinanet_resnet50_fpn": BuiltIn("retinanet", {"backbone": "resnet50"}),
    # the same detector with a lighter backbone (torchvision has no builder of it)
    "torchvision:retinanet_resnet18_fpn": BuiltIn("retinanet", {"backbone": "resnet18"}),
    "torchvision:retinanet_resnet50_fpn_v2": BuiltIn("retinanet", {"backbone": "resnet50_v2"}),
    "torchvision:fcos_resnet50_fpn": BuiltIn("fcos", {"backbone": "resnet50"}),
    **_torchvision("ssd", "ssd300_vgg16", "ssdlite320_mobilenet_v3_large", sized=False),
    **_torchvision(
        "rcnn",
        "fasterrcnn_resnet50_fpn",
        "fasterrcnn_resnet50_fpn_v2",
        "fasterrcnn_mobilenet_v3_large_fpn",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        "maskrcnn_resnet50_fpn",
        "maskrcnn_resnet50_fpn_v2",
    ),
}
DEFAULT = "torchvision:retinanet_resnet50_fpn"


def build(
    name: str,
    image_size: tuple[int, int] = (480, 640),
    weights=None,
    num_classes: int = 91,
    flag: str = "--weights",
):
    """The built-in model ``name`` (a key of ``CATALOG``) in eval mode for images of
    ``image_size``: with the state dict in the file ``weights`` (errors name ``flag``),
    else seeded random weights calibrated to a trained model's load (see each family's
    builder)."""
    model = CATALOG[name].build(image_size, num_classes, realistic_load=weights is None)
    if weights is not None:
        from bladesmith.models.weights import load_weights

        load_weights(model, weights, flag)
    return model


def build_retinanet(
    image_size: tuple[int, int] = (480, 640),
    weights=None,
    realistic_load: bool = True,
    num_classes: int = 91,
    backbone: str = "resnet50",
    seed: int = 0,
):
    """A torchvision RetinaNet in eval mode whose transform keeps ``image_size`` as is:
    ``families.retinanet.build_retinanet``'s (random, seeded, with ``realistic_load``
    calibrated to a trained model's load), or with the state dict in the local file
    ``weights`` (nothing is downloaded)."""
    from bladesmith.families.retinanet import build_retinanet as build_random
    from bladesmith.models.weights import load_weights

    model = build_random(
        image_size, realistic_load and weights is None, num_classes, backbone, seed
    )
    if weights is not None:
        load_weights(model, weights)
    return model
