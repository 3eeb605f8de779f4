"""One statement of each bladesmith operator's output shapes and dtypes: its fake kernel
(``ops.fake``). The kernels, the fake kernels and both ONNX translations (the types the
file declares, and what ONNX Runtime returns: ``contrib_ops`` in domain mode) agree on
every operator the export translates, at several input shapes; a changed fake kernel
changes what the export declares and what the contrib operators declare."""

from __future__ import annotations

import functools
import math

import numpy
import onnx
import pytest
import torch

from bladesmith.onnx import export, session

MODES = ("domain", "standard")
WEIGHTS = [1.0, 1.0, 2.0, 2.0]
BBOX_CLIP = math.log(1000.0 / 16)


@pytest.fixture(scope="module")
def fake():
    """``ops.fake``, importable once the library defines the operators."""
    from bladesmith import ops

    ops.load_library()
    from bladesmith.ops import fake

    return fake


def _decode_args(batch, levels, classes, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(levels)
    corner = torch.rand(n, 2, generator=g) * 100
    anchors = torch.cat([corner, corner + torch.rand(n, 2, generator=g) * 30 + 4], 1)
    cls_logits = torch.randn(batch, n, classes, generator=g)
    bbox_deltas = torch.randn(batch, n, 4, generator=g) * 0.3
    image_sizes = torch.tensor([[100, 120]]).repeat(batch, 1)
    return [cls_logits, bbox_deltas, anchors, list(levels), image_sizes, 0.05, topk]


def _nms_args(batch, count, max_detections, seed=0):
    g = torch.Generator().manual_seed(seed)
    corner = torch.rand(batch, count, 2, generator=g) * 50
    boxes = torch.cat([corner, corner + torch.rand(batch, count, 2, generator=g) * 20 + 1], 2)
    scores = torch.rand(batch, count, generator=g)
    labels = torch.randint(0, 3, (batch, count), generator=g)
    return [boxes, scores, labels, 0.5, max_detections]


def _roi_align_args(batch, channels, count, pooled, seed=0):
    g = torch.Generator().manual_seed(seed)
    heights, widths = [8, 4], [10, 5]
    rows = sum(h * w for h, w in zip(heights, widths))
    table = torch.randn(batch * rows, channels, generator=g)
    corner = torch.rand(count, 2, generator=g) * 20
    boxes = torch.cat([corner, corner + torch.rand(count, 2, generator=g) * 15 + 1], 1)
    images = torch.randint(0, batch, (count, 1), generator=g).float()
    level_of = torch.randint(0, 2, (count,), generator=g)
    rois = torch.cat([images, boxes], 1)
    return [table, rois, level_of, heights, widths, [0.25, 0.125], *pooled, 2]


# op -> calls at several shapes: fewer and more candidates than slots, per-level top-k
# above and below the levels' sizes, one image and several.
CASES = {
    "retinanet_decode": [
        [*_decode_args(1, (6, 4), 3, 5), WEIGHTS, BBOX_CLIP],
        [*_decode_args(2, (20, 8, 2), 2, 100), WEIGHTS, BBOX_CLIP],
    ],
    "batched_nms": [_nms_args(1, 5, 3), _nms_args(2, 7, 10)],
    "retinanet_postprocess": [
        [*_decode_args(1, (6, 4), 3, 5), 0.5, 4, WEIGHTS, BBOX_CLIP],
        [*_decode_args(2, (20, 8, 2), 2, 100), 0.5, 50, WEIGHTS, BBOX_CLIP],
    ],
    "multilevel_roi_align": [
        _roi_align_args(1, 3, 4, (2, 2)),
        _roi_align_args(2, 5, 9, (3, 2)),
    ],
}


class Call(torch.nn.Module):
    """``torch.ops.bladesmith.<op>(*args)``, the tensors among ``args`` as inputs."""

    def __init__(self, op: str, args: list):
        super().__init__()
        self.op, self.args = op, args
        self.positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]

    def inputs(self) -> tuple:
        return tuple(self.args[i] for i in self.positions)

    def forward(self, *tensors):
        args = list(self.args)
        for position, tensor in zip(self.positions, tensors):
            args[position] = tensor
        return getattr(torch.ops.bladesmith, self.op)(*args)


def _as_meta(args: list) -> list:
    return [
        torch.empty(arg.shape, dtype=arg.dtype, device="meta")
        if isinstance(arg, torch.Tensor)
        else arg
        for arg in args
    ]


def _types(tensors) -> list[tuple[list[int], torch.dtype]]:
    tensors = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    return [(list(t.shape), t.dtype) for t in map(torch.as_tensor, tensors)]


def _declared(path) -> list[tuple[list[int], torch.dtype]]:
    """The graph outputs' types as the file declares them."""
    from onnx.helper import tensor_dtype_to_np_dtype

    types = []
    for output in onnx.load(str(path)).graph.output:
        tensor = output.type.tensor_type
        dtype = torch.from_numpy(numpy.zeros(1, tensor_dtype_to_np_dtype(tensor.elem_type))).dtype
        types.append(([dim.dim_value for dim in tensor.shape.dim], dtype))
    return types


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "op, case", [(op, i) for op, calls in CASES.items() for i in range(len(calls))]
)
def test_kernel_fake_kernel_and_both_translations_agree(op, case, mode, fake, tmp_path):
    module = Call(op, CASES[op][case])
    with torch.no_grad():
        kernel = _types(module(*module.inputs()))
    assert fake.output_types(op, *_as_meta(module.args)) == kernel
    path = export(module, module.inputs(), tmp_path / f"{op}.onnx", custom_ops=mode)
    assert _declared(path) == kernel
    assert _types(session(path, device="cpu")(*module.inputs())) == kernel


def _changed(original, change):
    """The fake kernel ``original`` with ``change`` applied to its outputs."""

    @functools.wraps(original)  # the same parameters: the export names them
    def changed(*args):
        return change(original(*args))

    return changed


def test_a_changed_fake_kernel_changes_the_export_and_the_contrib_operators(
    monkeypatch, fake, tmp_path
):
    from bladesmith.onnx import contrib_ops

    module = Call("batched_nms", CASES["batched_nms"][1])
    before = _declared(export(module, module.inputs(), tmp_path / "a.onnx"))
    assert contrib_ops._outputs("batched_nms", *contrib_ops._NMS_CALL) == [
        contrib_ops._F,
        contrib_ops._F,
        contrib_ops._I,
        contrib_ops._I,
    ]

    def one_slot_more_and_a_float_count(outputs):
        boxes, scores, labels, count = outputs
        wider = [x.new_empty((x.shape[0], x.shape[1] + 1, *x.shape[2:])) for x in outputs[:3]]
        return (*wider, count.float())

    changed = _changed(fake.FAKES["batched_nms"], one_slot_more_and_a_float_count)
    monkeypatch.setitem(fake.FAKES, "batched_nms", changed)
    after = _declared(export(module, module.inputs(), tmp_path / "b.onnx"))
    assert before == [
        ([2, 10, 4], torch.float32),
        ([2, 10], torch.float32),
        ([2, 10], torch.int64),
        ([2], torch.int64),
    ]
    assert after == [
        ([2, 11, 4], torch.float32),
        ([2, 11], torch.float32),
        ([2, 11], torch.int64),
        ([2], torch.float32),
    ]
    assert contrib_ops._outputs("batched_nms", *contrib_ops._NMS_CALL) == [
        contrib_ops._F,
        contrib_ops._F,
        contrib_ops._I,
        contrib_ops._F,
    ]
