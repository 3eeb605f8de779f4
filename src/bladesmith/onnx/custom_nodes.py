"""The user's custom nodes as an exported file lists them (``user_ops`` writes the list
into the file's metadata): read without torch, which ``check`` does not import."""

from __future__ import annotations

import json

DOMAIN = "ai.onnx.contrib"  # the only domain onnxruntime-extensions runs Python operators in
METADATA_KEY = "bladesmith.custom_nodes"
DEFAULT_IMPL = "pytorch"  # an entry's ort_impl: the operator's PyTorch kernel


def listed(model) -> list[dict]:
    """The custom nodes ``model`` (an ``onnx.ModelProto``) lists: ``operator`` (the
    user's, "myops::scale_clip"), ``op_type`` and ``ort_impl`` each; none for a file
    without the list."""
    return next((json.loads(p.value) for p in model.metadata_props if p.key == METADATA_KEY), [])
