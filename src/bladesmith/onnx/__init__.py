"""ONNX: export, run on ONNX Runtime, check a model against a target's rules, fix it.

    bladesmith.onnx.export(model, images, "model.onnx", custom_ops="standard")
    session = bladesmith.onnx.session("model.onnx", device="auto")
    boxes, scores, labels, num_detections = session(images)

Names are imported on first use, so that importing this package stays cheap.
"""

from __future__ import annotations

import importlib
import sys
import types

# public name -> (module, attribute)
_EXPORTS = {
    "export": ("bladesmith.onnx.export", "export"),
    "session": ("bladesmith.onnx.runtime", "session"),
    "Session": ("bladesmith.onnx.runtime", "Session"),
    "plan_providers": ("bladesmith.onnx.runtime", "plan_providers"),
    "check": ("bladesmith.onnx.check", "check"),
    "fix": ("bladesmith.onnx.fix", "fix"),
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


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # The import system binds each submodule to its package as it loads it, and
        # export.py, check.py and fix.py share their function's name: keep the function.
        if not (name in _EXPORTS and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
