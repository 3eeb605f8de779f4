"""ONNX: export, run on ONNX Runtime, check a model against a target's rules, fix it.

    bladesmith.onnx.export(model, images, "model.onnx", custom_ops="standard")
    session = bladesmith.onnx.session("model.onnx", device="auto")
    boxes, scores, labels, num_detections = session(images)

Names are imported on first use, so that importing this package stays cheap. No module
here is named like a function it exports (``exporter`` defines ``export``, ``checker``
``check``, ``fixer`` ``fix``): importing a module never hides the function.
"""

from __future__ import annotations

import importlib

# public name -> (module, attribute)
_EXPORTS = {
    "export": ("bladesmith.onnx.exporter", "export"),
    "session": ("bladesmith.onnx.sessions", "session"),
    "Session": ("bladesmith.onnx.sessions", "Session"),
    "plan_providers": ("bladesmith.onnx.sessions", "plan_providers"),
    "check": ("bladesmith.onnx.checker", "check"),
    "fix": ("bladesmith.onnx.fixer", "fix"),
    "register_op": ("bladesmith.onnx.user_ops", "register_op"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'bladesmith.onnx' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
