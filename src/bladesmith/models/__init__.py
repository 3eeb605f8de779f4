"""The built-in models (``builtin.build_retinanet``: torchvision's RetinaNet, nothing
downloaded), the photographs they are tried on (``images``), and convolution helpers the
passes share (``convs``). ``build_retinanet`` is imported on first use: the families
import ``images`` from here, and the built-in RetinaNet is built on its family's
pipeline."""


def __getattr__(name: str):
    if name == "build_retinanet":
        from bladesmith.models.builtin import build_retinanet

        return build_retinanet
    raise AttributeError(f"module 'bladesmith.models' has no attribute {name!r}")


__all__ = ["build_retinanet"]
