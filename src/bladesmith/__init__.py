"""bladesmith: turn a PyTorch model into a faster, verified, deployable artifact.

The public API is imported lazily, so that ``import bladesmith`` and the command line's
``--help`` stay fast; torch is imported on first use of a name below.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself.
_EXPORTS = {
    "optimize": ("bladesmith.engine", "optimize"),
    "Config": ("bladesmith.config", "Config"),
    "save": ("bladesmith.artifact", "save"),
    "load": ("bladesmith.artifact", "load"),
    "Report": ("bladesmith.report", "Report"),
    "doctor": ("bladesmith.environment", "doctor"),
    "devices": ("bladesmith.devices", None),
    "ops": ("bladesmith.ops", None),
    "onnx": ("bladesmith.onnx", None),
    "serve": ("bladesmith.serve", None),  # the package, callable as serve.serve
    "client": ("bladesmith.serve.client", "client"),
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'bladesmith' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
