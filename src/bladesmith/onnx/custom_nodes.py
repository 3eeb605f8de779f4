"""The custom nodes of bladesmith's exports, known without torch, which ``check`` does
not import: bladesmith's own operators' (``OP_TYPES``, ``custom_ops="domain"``), and the
user's as an exported file lists them (``user_ops`` writes the list into the file's
metadata)."""

from __future__ import annotations

import json

DOMAIN = "ai.onnx.contrib"  # the only domain onnxruntime-extensions runs Python operators in
OP_TYPES = {  # torch.ops.bladesmith's operator -> its node's op type
    "retinanet_decode": "BladesmithRetinaNetDecode",
    "batched_nms": "BladesmithBatchedNms",
    "retinanet_postprocess": "BladesmithRetinaNetPostprocess",
}
METADATA_KEY = "bladesmith.custom_nodes"
DEFAULT_IMPL = "pytorch"  # an entry's ort_impl: the operator's PyTorch kernel


def listed(model) -> list[dict]:
    """The custom nodes ``model`` (an ``onnx.ModelProto``) lists: ``operator`` (the
    user's, "myops::scale_clip"), ``op_type`` and ``ort_impl`` each; none for a file
    without the list."""
    return next((json.loads(p.value) for p in model.metadata_props if p.key == METADATA_KEY), [])
