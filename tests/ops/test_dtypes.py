"""float16 and bfloat16 inputs against float32 ones holding the same values."""

import pytest
import torch
from ops_testing import assert_same_detections, logit, make_decode_inputs

from bladesmith.ops import batched_nms, retinanet_decode, retinanet_postprocess

# Boxes and scores of reduced precision, against float32: (box rtol, box atol, score atol).
TOLERANCES = {torch.float16: (2e-3, 0.1, 1e-3), torch.bfloat16: (1.6e-2, 0.6, 8e-3)}
THRESHOLD = 0.3


def reduced_inputs(dtype, seed=31):
    """Inputs rounded to dtype, with no logit near the threshold's, so that rounding of the
    scores cannot decide which candidates pass."""
    inputs = make_decode_inputs(seed, 2, [40, 12, 3], 4, logit_mean=0.0)
    logits = inputs["cls_logits"]
    near = (logits - logit(THRESHOLD)).abs() < 0.2
    inputs["cls_logits"] = torch.where(near, logits + 0.4, logits)
    for name in ("cls_logits", "bbox_deltas", "anchors"):
        inputs[name] = inputs[name].to(dtype)
    return inputs


def as_float32(inputs):
    return {
        k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


@pytest.mark.parametrize("dtype", TOLERANCES)
def test_decode_matches_float32(dtype):
    inputs = reduced_inputs(dtype)
    # topk above every level's N * C: no cut whose edge a rounded score could move.
    ours = retinanet_decode(**inputs, score_threshold=THRESHOLD, topk_candidates=200)
    ref = retinanet_decode(**as_float32(inputs), score_threshold=THRESHOLD, topk_candidates=200)
    assert all(t.dtype == dtype for t in ours[:2])
    assert torch.equal(ours[2] != -1, ref[2] != -1)
    box_rtol, box_atol, score_atol = TOLERANCES[dtype]
    for b in range(2):
        valid = ref[2][b] != -1
        reference = dict(zip(("boxes", "scores", "labels"), (t[b][valid] for t in ref)))
        assert_same_detections(
            tuple(t[b][valid] for t in ours),
            reference,
            box_rtol=box_rtol,
            box_atol=box_atol,
            score_atol=score_atol,
        )


@pytest.mark.parametrize("dtype", TOLERANCES)
def test_nms_matches_float32_exactly_on_representable_values(dtype):
    g = torch.Generator().manual_seed(32)
    corner = torch.randint(0, 128, (2, 60, 2), generator=g) / 4
    boxes = torch.cat([corner, corner + torch.randint(1, 64, (2, 60, 2), generator=g) / 4], -1)
    scores = (torch.rand(2, 256, generator=g).argsort(1)[:, :60] + 1) / 256
    labels = torch.randint(0, 3, (2, 60), generator=g)
    ours = batched_nms(boxes.to(dtype), scores.to(dtype), labels, 0.5, 40)
    ref = batched_nms(boxes, scores, labels, 0.5, 40)
    assert ours[0].dtype == ours[1].dtype == dtype
    for a, b in zip(ours, ref):
        assert torch.equal(a.float() if a.is_floating_point() else a, b)


@pytest.mark.parametrize("dtype", TOLERANCES)
def test_postprocess_composes_in_reduced_precision(dtype):
    inputs = reduced_inputs(dtype, seed=33)
    decoded = retinanet_decode(**inputs, score_threshold=THRESHOLD, topk_candidates=50)
    fused = retinanet_postprocess(
        **inputs,
        score_threshold=THRESHOLD,
        topk_candidates=50,
        iou_threshold=0.5,
        max_detections=30,
    )
    for a, b in zip(fused, batched_nms(*decoded, 0.5, 30)):
        assert torch.equal(a, b)
    assert fused[0].dtype == dtype and int(fused[3].min()) > 0
