"""The operators under torch.library.opcheck, torch.compile, torch.export and TorchScript."""

import subprocess
import sys
import textwrap

import pytest
import torch
from ops_testing import make_decode_inputs

import bladesmith.ops
from bladesmith.ops import library_path

LEVELS = [30, 8, 2]
ARGS = dict(score_threshold=0.2, topk_candidates=12)
NMS_ARGS = dict(iou_threshold=0.5, max_detections=10)


def inputs(batch=2, seed=41):
    return make_decode_inputs(seed, batch, LEVELS, 3, logit_mean=0.0)


def tensors(batch=2, seed=41):
    i = inputs(batch, seed)
    return i["cls_logits"], i["bbox_deltas"], i["anchors"], i["image_sizes"]


class Postprocess(torch.nn.Module):
    """A module as a detector ends: the raw ops, as TorchScript and export need them."""

    def forward(self, cls_logits, bbox_deltas, anchors, image_sizes):
        boxes, scores, labels = torch.ops.bladesmith.retinanet_decode(
            cls_logits, bbox_deltas, anchors, [30, 8, 2], image_sizes, 0.2, 12
        )
        fused = torch.ops.bladesmith.retinanet_postprocess(
            cls_logits, bbox_deltas, anchors, [30, 8, 2], image_sizes, 0.2, 12, 0.5, 10
        )
        return fused, torch.ops.bladesmith.batched_nms(boxes, scores, labels, 0.5, 10)


def assert_equal_outputs(a, b):
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(flat_a) == len(flat_b)
    assert all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


@pytest.mark.parametrize("per_image_anchors", [False, True])
def test_opcheck(per_image_anchors):
    i = make_decode_inputs(42, 2, LEVELS, 3, logit_mean=0.0, per_image_anchors=per_image_anchors)
    decode_args = (
        i["cls_logits"],
        i["bbox_deltas"],
        i["anchors"],
        LEVELS,
        i["image_sizes"],
        0.2,
        12,
        [1.0, 2.0, 1.0, 1.0],
        3.0,
    )
    ops = torch.ops.bladesmith
    torch.library.opcheck(ops.retinanet_decode.default, decode_args)
    decoded = ops.retinanet_decode(*decode_args)
    torch.library.opcheck(ops.batched_nms.default, (*decoded, 0.5, 10))
    torch.library.opcheck(
        ops.retinanet_postprocess.default, (*decode_args[:7], 0.5, 10, *decode_args[7:])
    )


def test_compile_fullgraph_with_dynamic_batch():
    def detect(cls_logits, bbox_deltas, anchors, image_sizes):
        # Through the Python wrappers, which must trace too.
        return bladesmith.ops.retinanet_postprocess(
            cls_logits, bbox_deltas, anchors, LEVELS, image_sizes, **ARGS, **NMS_ARGS
        )

    compiled = torch.compile(detect, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch in (2, 3):
        assert_equal_outputs(compiled(*tensors(batch)), detect(*tensors(batch)))


def test_compile_with_inductor():
    module = Postprocess()
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    assert_equal_outputs(compiled(*tensors()), module(*tensors()))


def test_export_keeps_each_operator_as_one_node():
    program = torch.export.export(Postprocess(), tensors())
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    ours = [t for t in targets if getattr(t, "namespace", None) == "bladesmith"]
    assert sorted(str(t) for t in ours) == [
        "bladesmith.batched_nms.default",
        "bladesmith.retinanet_decode.default",
        "bladesmith.retinanet_postprocess.default",
    ]
    assert_equal_outputs(program.module()(*tensors(seed=43)), Postprocess()(*tensors(seed=43)))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_loads_with_only_the_library(tmp_path):
    scripted = torch.jit.script(Postprocess())
    scripted.save(str(tmp_path / "model.pt"))
    torch.save((tensors(seed=44), Postprocess()(*tensors(seed=44))), tmp_path / "io.pt")
    # A fresh interpreter with no bladesmith: the library and the TorchScript file suffice.
    script = textwrap.dedent(
        f"""
        import sys, torch
        torch.ops.load_library({library_path()!r})
        model = torch.jit.load({str(tmp_path / "model.pt")!r})
        args, expected = torch.load({str(tmp_path / "io.pt")!r})
        out = model(*args)
        flat = lambda t: torch.utils._pytree.tree_leaves(t)
        assert all(torch.equal(a, b) for a, b in zip(flat(out), flat(expected)))
        assert not any(name.startswith("bladesmith") for name in sys.modules), "imported"
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
