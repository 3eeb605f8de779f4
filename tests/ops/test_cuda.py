"""The CUDA kernels against torchvision run on CUDA, the CPU kernels, and the operators'
definition written in plain torch ops; plus CUDA graphs, host synchronisation and
torch.compile."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_testing import (
    NO_SUPPRESSION,
    UNIT_WEIGHTS,
    assert_descending,
    assert_padding,
    assert_same_detections,
    decode_cases,
    level_topk,
    make_decode_inputs,
    make_nms_inputs,
    torchvision_level_candidates,
    torchvision_nms,
    torchvision_postprocess,
)

from bladesmith.ops import BBOX_CLIP, batched_nms, retinanet_decode, retinanet_postprocess

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
REDUCED = (torch.float16, torch.bfloat16)
# Boxes against the exact definition: (rtol, atol) by dtype, about one ulp of the output.
EXACT_BOX_TOLERANCE = {
    torch.float32: (1e-6, 1e-4),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 1e-1),
}
# CPU against CUDA, whose exp may differ by an ulp: (box rtol, box atol, score atol).
CPU_TOLERANCE = {
    torch.float32: (1e-5, 1e-4, 5e-7),
    torch.float16: (2e-3, 0.1, 1e-3),
    torch.bfloat16: (1.6e-2, 0.6, 8e-3),
}
# The 480x640 geometry of the issue: five levels of 9 anchors per position, 80 classes.
RETINANET_LEVELS = [43200, 10800, 2700, 720, 180]


def moved(inputs: dict, device, dtype=None) -> dict:
    """The inputs on `device`, float tensors cast to `dtype` when given."""
    out = {}
    for name, value in inputs.items():
        if torch.is_tensor(value):
            value = value.to(device)
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
        out[name] = value
    return out


def on_cpu(tensors):
    return tuple(t.cpu() for t in tensors)


def assert_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.cpu(), y.cpu()), f"differ:\n{x}\n{y}"


# The definition of retinanet_decode in plain torch ops (checks.h): torch's CUDA sigmoid and
# exp are the kernels' formulas, so on CUDA this gives the same bits.


def exact_decode(inputs, score_threshold, topk, weights=UNIT_WEIGHTS, bbox_clip=BBOX_CLIP):
    logits, deltas = inputs["cls_logits"], inputs["bbox_deltas"]
    dtype, device = logits.dtype, logits.device
    batch, _, num_classes = logits.shape
    anchors = inputs["anchors"]
    if anchors.dim() == 2:
        anchors = anchors.expand(batch, -1, -1)
    levels = inputs["level_sizes"]
    ks = level_topk(levels, num_classes, topk)
    K = sum(ks)
    boxes = torch.zeros(batch, K, 4, dtype=dtype, device=device)
    scores = torch.zeros(batch, K, dtype=dtype, device=device)
    labels = torch.full((batch, K), -1, dtype=torch.int64, device=device)
    # The threshold as a Python float meets a tensor of `dtype`: rounded through float32.
    threshold = torch.tensor(score_threshold, dtype=torch.float32).to(dtype).float().item()
    weight = torch.tensor(weights, dtype=torch.float32, device=device)  # true division
    first_anchor, first_slot = 0, 0
    for size, k in zip(levels, ks):
        for b in range(batch):
            x = logits[b, first_anchor : first_anchor + size].flatten().float()
            s = torch.sigmoid(x).to(dtype).float()
            passing = s > threshold
            # Stable: equal scores keep the lower index first.
            order = torch.where(passing, s, -1.0).sort(descending=True, stable=True).indices
            count = min(k, int(passing.sum()))
            index = order[:count]
            anchor = first_anchor + torch.div(index, num_classes, rounding_mode="floor")
            a, d = anchors[b, anchor].float(), deltas[b, anchor].float()
            widths, heights = a[:, 2] - a[:, 0], a[:, 3] - a[:, 1]
            ctr_x, ctr_y = a[:, 0] + 0.5 * widths, a[:, 1] + 0.5 * heights
            dx, dy = d[:, 0] / weight[0], d[:, 1] / weight[1]
            dw = (d[:, 2] / weight[2]).clamp(max=bbox_clip)
            dh = (d[:, 3] / weight[3]).clamp(max=bbox_clip)
            pred_ctr_x, pred_ctr_y = dx * widths + ctr_x, dy * heights + ctr_y
            half_w, half_h = 0.5 * (torch.exp(dw) * widths), 0.5 * (torch.exp(dh) * heights)
            height, width = (float(v) for v in inputs["image_sizes"][b])
            decoded = torch.stack(
                [
                    (pred_ctr_x - half_w).clamp(0, width),
                    (pred_ctr_y - half_h).clamp(0, height),
                    (pred_ctr_x + half_w).clamp(0, width),
                    (pred_ctr_y + half_h).clamp(0, height),
                ],
                dim=1,
            )
            slots = slice(first_slot, first_slot + count)
            boxes[b, slots] = decoded.to(dtype)
            scores[b, slots] = s[index].to(dtype)
            labels[b, slots] = index % num_classes
        first_anchor += size
        first_slot += k
    return boxes, scores, labels


def assert_exact_decode(inputs, score_threshold, topk, **coder):
    """Same candidates in the same slots as the definition: labels and scores bit for bit."""
    ours = retinanet_decode(
        **inputs, score_threshold=score_threshold, topk_candidates=topk, **coder
    )
    ref = exact_decode(inputs, score_threshold, topk, **coder)
    assert torch.equal(ours[2], ref[2]), "labels differ"
    assert torch.equal(ours[1], ref[1]), "scores differ"
    rtol, atol = EXACT_BOX_TOLERANCE[ours[0].dtype]
    torch.testing.assert_close(ours[0], ref[0], rtol=rtol, atol=atol, equal_nan=True)
    return ours


def assert_same_candidates(ours, theirs, ks):
    """Per image and level the same candidates within tolerance, in any order."""
    box_rtol, box_atol, score_atol = CPU_TOLERANCE[ours[0].dtype]
    start = 0
    for k in ks:
        for b in range(ours[0].shape[0]):
            mine = [t[b, start : start + k].cpu() for t in ours]
            other = [t[b, start : start + k].cpu() for t in theirs]
            assert_padding(*mine)
            n = int((mine[2] != -1).sum())
            assert n == int((other[2] != -1).sum())
            reference = dict(zip(("boxes", "scores", "labels"), (t[:n] for t in other)))
            assert_same_detections(
                tuple(t[:n] for t in mine),
                reference,
                box_rtol=box_rtol,
                box_atol=box_atol,
                score_atol=score_atol,
            )
        start += k


# retinanet_decode


@settings(max_examples=30, deadline=None)
@given(
    case=decode_cases(max_level_size=60, max_levels=5, max_classes=7),
    topk=st.integers(0, 80),
    score_threshold=st.sampled_from([0.05, 0.3, 0.9]),
    weights=st.sampled_from([UNIT_WEIGHTS, (10.0, 10.0, 5.0, 5.0)]),
)
def test_decode_random_cases(case, topk, score_threshold, weights):
    inputs = make_decode_inputs(**case)
    cuda_inputs = moved(inputs, CUDA)
    ours = assert_exact_decode(cuda_inputs, score_threshold, topk, weights=weights)
    ks = level_topk(inputs["level_sizes"], case["num_classes"], topk)
    cpu = retinanet_decode(
        **inputs, score_threshold=score_threshold, topk_candidates=topk, weights=weights
    )
    assert_same_candidates(ours, cpu, ks)
    start = 0
    for level, k in enumerate(ks):
        reference = torchvision_level_candidates(
            cuda_inputs, level, score_threshold, topk, weights=weights, bbox_clip=BBOX_CLIP
        )
        for b in range(case["batch"]):
            mine = [t[b, start : start + k].cpu() for t in ours]
            count = int((mine[2] != -1).sum())
            mine = [t[:count] for t in mine]
            assert_descending(mine[1])
            assert_same_detections(tuple(mine), {key: v.cpu() for key, v in reference[b].items()})
        start += k


@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED])
def test_decode_retinanet_geometry(dtype):
    # The benchmark's load: thousands of the 80 classes' logits pass on every level.
    inputs = make_decode_inputs(5, 2, RETINANET_LEVELS, 80, logit_mean=-5.0, max_image_size=640)
    cuda_inputs = moved(inputs, CUDA, dtype)
    boxes, scores, labels = assert_exact_decode(cuda_inputs, 0.05, 1000)
    assert int((labels != -1).sum()) == 2 * 5000


def test_decode_equal_logits_take_the_lowest_indices():
    # One score everywhere: the radix select runs down to the index bits.
    inputs = make_decode_inputs(6, 2, [30000, 700, 3], 8)
    inputs["cls_logits"] = torch.full_like(inputs["cls_logits"], 0.5)
    _, _, labels = assert_exact_decode(moved(inputs, CUDA), 0.05, 1000)
    assert torch.equal(labels[:, :1000].cpu(), torch.arange(1000).remainder(8).expand(2, -1))


def test_decode_scores_within_one_bin():
    # Distinct scores packed closer than the first radix digit resolves.
    inputs = make_decode_inputs(7, 1, [50000, 1000], 4)
    n = inputs["cls_logits"].numel()
    narrow = 1.0 + torch.randperm(n, generator=torch.Generator().manual_seed(7)) * 1e-6
    inputs["cls_logits"] = narrow.view_as(inputs["cls_logits"])
    assert_exact_decode(moved(inputs, CUDA), 0.05, 3000)


@pytest.mark.parametrize("topk", [9000, 30000])
def test_decode_large_topk(topk):
    # Levels beyond one block's sort go through CUB's segmented radix sort.
    inputs = make_decode_inputs(8, 2, [20000, 3000], 2, logit_mean=0.0)
    assert_exact_decode(moved(inputs, CUDA), 0.05, topk)


def test_decode_unaligned_inputs():
    # Odd C and a storage offset: the scalar-load path.
    inputs = make_decode_inputs(9, 2, [501, 77, 3], 3, logit_mean=0.0)
    logits = inputs["cls_logits"]
    storage = torch.empty(logits.numel() + 1, device=CUDA)
    shifted = storage[1:].view_as(logits).copy_(logits)
    assert shifted.data_ptr() % 16 != 0
    cuda_inputs = moved(inputs, CUDA)
    cuda_inputs["cls_logits"] = shifted
    assert_exact_decode(cuda_inputs, 0.2, 100)


@pytest.mark.parametrize("threshold", [-0.5, 0.0, 0.999, 1.0, math.inf])
def test_decode_thresholds(threshold):
    inputs = make_decode_inputs(10, 2, [200, 40], 5, logit_mean=0.0)
    inputs["cls_logits"][0, :50] = -200.0  # sigmoid 0 exactly
    inputs["cls_logits"][1, :50] = 200.0  # sigmoid 1 exactly
    assert_exact_decode(moved(inputs, CUDA), threshold, 150)


def test_decode_nan_logits_never_pass():
    inputs = make_decode_inputs(11, 2, [300, 60], 4, logit_mean=1.0)
    inputs["cls_logits"][:, ::3] = math.nan
    _, scores, _ = assert_exact_decode(moved(inputs, CUDA), 0.05, 500)
    assert not scores.isnan().any()


def test_decode_degenerate_and_extreme_boxes():
    inputs = make_decode_inputs(12, 2, [120, 30], 3, logit_mean=1.0)
    inputs["anchors"][::2, 2:] = inputs["anchors"][::2, :2]  # zero-size anchors
    inputs["bbox_deltas"][:, ::5] = torch.tensor([1e4, -1e4, 50.0, -50.0])
    inputs["bbox_deltas"][:, 1::7] = math.nan
    assert_exact_decode(moved(inputs, CUDA), 0.05, 100)


@pytest.mark.parametrize("batch,topk", [(0, 100), (3, 0)])
def test_decode_empty(batch, topk):
    inputs = make_decode_inputs(13, batch, [20, 5], 3)
    boxes, scores, labels = retinanet_decode(
        **moved(inputs, CUDA), score_threshold=0.05, topk_candidates=topk
    )
    K = sum(level_topk([20, 5], 3, topk))
    assert boxes.shape == (batch, K, 4) and scores.shape == labels.shape == (batch, K)
    assert boxes.device.type == "cuda"


def test_decode_no_candidate_above_threshold():
    inputs = make_decode_inputs(14, 2, [100, 20], 4, logit_mean=-12.0)
    boxes, scores, labels = retinanet_decode(
        **moved(inputs, CUDA), score_threshold=0.05, topk_candidates=50
    )
    assert bool((labels == -1).all() and (scores == 0).all() and (boxes == 0).all())


@pytest.mark.parametrize("dtype", REDUCED)
def test_decode_reduced_precision_matches_cpu(dtype):
    inputs = make_decode_inputs(15, 2, [400, 100, 9], 6, logit_mean=0.0)
    cpu_inputs = moved(inputs, "cpu", dtype)
    # Rounded scores tie often, and ties go to the lower index: still exact on CUDA.
    ours = assert_exact_decode(moved(cpu_inputs, CUDA), 0.3, 300)
    cpu = retinanet_decode(**cpu_inputs, score_threshold=0.3, topk_candidates=300)
    assert ours[0].dtype == dtype
    assert_same_candidates(ours, cpu, level_topk([400, 100, 9], 6, 300))


def test_decode_too_many_levels():
    inputs = make_decode_inputs(16, 1, [2] * 17, 2)
    with pytest.raises(ValueError, match="level_sizes"):
        retinanet_decode(**moved(inputs, CUDA), score_threshold=0.05, topk_candidates=5)


def test_decode_checks_devices():
    inputs = moved(make_decode_inputs(17, 1, [10], 2), CUDA)
    inputs["anchors"] = inputs["anchors"].cpu()
    with pytest.raises(ValueError, match="anchors"):
        retinanet_decode(**inputs, score_threshold=0.05, topk_candidates=5)


# batched_nms


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(0, 3),
    num_boxes=st.integers(0, 400),
    num_labels=st.integers(1, 5),
    padding=st.sampled_from([0.0, 0.3]),
    iou_threshold=st.sampled_from([0.0, 0.3, 0.5, 0.7, 1.0]),
    max_detections=st.integers(0, 300),
)
def test_nms_random_cases(
    seed, batch, num_boxes, num_labels, padding, iou_threshold, max_detections
):
    inputs = make_nms_inputs(seed, batch, num_boxes, num_labels, padding)
    ours = batched_nms(*(t.to(CUDA) for t in inputs), iou_threshold, max_detections)
    assert_equal(ours, batched_nms(*inputs, iou_threshold, max_detections))
    if iou_threshold != 0.5:
        return  # torchvision's CUDA kernel compares with a float threshold: 0.5 is exact
    references = torchvision_nms(*(t.to(CUDA) for t in inputs), iou_threshold, max_detections)
    for b, reference in enumerate(references):
        n = int(ours[3][b])
        mine = tuple(t[b, :n].cpu() for t in ours[:3])
        assert_same_detections(mine, dict(zip(("boxes", "scores", "labels"), on_cpu(reference))))


def many_nms_inputs(seed, batch, num_boxes, num_labels):
    """Like make_nms_inputs (1/4 grid, zero-area boxes too), for any number of boxes:
    distinct scores from a permutation."""
    g = torch.Generator().manual_seed(seed)
    corner = torch.randint(0, 640, (batch, num_boxes, 2), generator=g) / 4
    extent = torch.randint(0, 160, (batch, num_boxes, 2), generator=g) / 4
    scores = torch.stack([torch.randperm(num_boxes, generator=g) for _ in range(batch)])
    labels = torch.randint(0, num_labels, (batch, num_boxes), generator=g)
    labels[:, ::10] = -1
    return torch.cat([corner, corner + extent], -1), (scores + 1) / (num_boxes + 1), labels


# Sort paths: one tile (<= 1024), tiles merged (<= 8192), CUB's device-wide radix sort
# (larger; one image alone, or several sorted together then apart by image).
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("num_boxes", [1024, 1025, 5000, 8192, 8193, 12000, 90000])
def test_nms_large(num_boxes, batch):
    inputs = many_nms_inputs(18, batch, num_boxes, 3)
    for threshold, max_detections in ((0.3, 300), (0.7, num_boxes)):
        ours = batched_nms(*(t.to(CUDA) for t in inputs), threshold, max_detections)
        assert_equal(ours, batched_nms(*inputs, threshold, max_detections))


def test_nms_sorts_equal_scores_of_several_large_images_apart():
    # Every score equal: the order is the slots' in each image, whatever the other images
    # hold (the image sort must be stable and must not mix images).
    boxes, _, labels = many_nms_inputs(24, 3, 20000, 5)
    scores = torch.full(labels.shape, 0.5)
    scores[1, ::7] = 0.75
    ours = batched_nms(boxes.to(CUDA), scores.to(CUDA), labels.to(CUDA), 0.5, 2000)
    assert_equal(ours, batched_nms(boxes, scores, labels, 0.5, 2000))


def test_nms_suppression_by_detections_past_the_kept_cache():
    # 2000 distinct boxes of one label, each followed later by a lower-scoring copy that
    # only its original suppresses: most originals are kept beyond the 512 that a block
    # caches in shared memory.
    boxes, scores, labels = make_nms_inputs(19, 2, 2000, 1)
    boxes = torch.cat([boxes, boxes], 1)
    scores = torch.cat([scores, scores / 2], 1)
    labels = torch.cat([labels, labels], 1)
    ours = batched_nms(boxes.to(CUDA), scores.to(CUDA), labels.to(CUDA), 0.9, 4000)
    assert_equal(ours, batched_nms(boxes, scores, labels, 0.9, 4000))
    assert bool((ours[3] > 1200).all())


def test_nms_labels_sharing_a_bucket():
    # Labels are split into buckets (label mod the bucket count, at most 64), one block
    # each: labels that share a bucket (multiples of 128 always do), and one label
    # throughout (the longest lists), must not mix.
    boxes, scores, labels = make_nms_inputs(23, 3, 3000, 3)
    labels = labels.where(labels < 0, labels * 128 + (1 << 40) * (labels == 2))
    labels[1] = labels[1].clamp(max=0)
    ours = batched_nms(boxes.to(CUDA), scores.to(CUDA), labels.to(CUDA), 0.5, 3000)
    assert_equal(ours, batched_nms(boxes, scores, labels, 0.5, 3000))
    assert len(torch.unique(ours[2][0])) == 4  # three labels and the padding


def test_nms_edge_cases():
    boxes, scores, labels = make_nms_inputs(20, 3, 200, 2)
    scores[0, ::4] = math.nan  # never selected
    scores[1, :20] = -math.inf  # valid, last
    scores[1, 20:30] = -0.0
    scores[1, 30:40] = 0.0
    boxes[2, :50] = boxes[2, :1]  # identical
    boxes[2, 50:100, 2:] = boxes[2, 50:100, :2]  # zero area: IoU NaN suppresses nothing
    labels[2, 150:] = -1
    for threshold in (0.0, 0.5):
        ours = batched_nms(boxes.to(CUDA), scores.to(CUDA), labels.to(CUDA), threshold, 150)
        assert_equal(ours, batched_nms(boxes, scores, labels, threshold, 150))


@pytest.mark.parametrize("batch,num_boxes,max_detections", [(0, 10, 5), (2, 0, 5), (2, 10, 0)])
def test_nms_empty(batch, num_boxes, max_detections):
    inputs = make_nms_inputs(21, batch, num_boxes, 2)
    ours = batched_nms(*(t.to(CUDA) for t in inputs), 0.5, max_detections)
    assert_equal(ours, batched_nms(*inputs, 0.5, max_detections))


@pytest.mark.parametrize("dtype", REDUCED)
def test_nms_reduced_precision(dtype):
    boxes, scores, labels = make_nms_inputs(22, 2, 500, 3)
    boxes, scores = boxes.to(dtype), scores.to(dtype)  # many scores now tie
    ours = batched_nms(boxes.to(CUDA), scores.to(CUDA), labels.to(CUDA), 0.5, 200)
    assert_equal(ours, batched_nms(boxes, scores, labels, 0.5, 200))
    as_float = batched_nms(
        boxes.float().to(CUDA), scores.float().to(CUDA), labels.to(CUDA), 0.5, 200
    )
    assert_equal([t.float() if t.is_floating_point() else t for t in ours], as_float)


# retinanet_postprocess

POST = dict(score_threshold=0.05, topk_candidates=1000, iou_threshold=0.5, max_detections=300)


def assert_fused_equals_composite(
    inputs, score_threshold, topk_candidates, iou_threshold, max_detections, **coder
):
    fused = retinanet_postprocess(
        **inputs,
        score_threshold=score_threshold,
        topk_candidates=topk_candidates,
        iou_threshold=iou_threshold,
        max_detections=max_detections,
        **coder,
    )
    decoded = retinanet_decode(
        **inputs, score_threshold=score_threshold, topk_candidates=topk_candidates, **coder
    )
    composite = batched_nms(*decoded, iou_threshold, max_detections)
    assert_equal(fused, composite)
    # The NMS half against the CPU kernel, on the very same candidates.
    assert_equal(composite, batched_nms(*on_cpu(decoded), iou_threshold, max_detections))
    return fused


@settings(max_examples=30, deadline=None)
@given(
    case=decode_cases(max_level_size=60, max_levels=5, max_classes=7),
    topk=st.integers(0, 80),
    score_threshold=st.sampled_from([0.05, 0.3]),
    iou_threshold=st.sampled_from([0.3, 0.5, 0.7]),
    max_detections=st.integers(0, 60),
    dtype=st.sampled_from([torch.float32, *REDUCED]),
)
def test_postprocess_random_cases(
    case, topk, score_threshold, iou_threshold, max_detections, dtype
):
    inputs = moved(make_decode_inputs(**case), CUDA, dtype)
    fused = assert_fused_equals_composite(
        inputs, score_threshold, topk, iou_threshold, max_detections
    )
    if dtype != torch.float32 or iou_threshold != 0.5:
        return
    reference = torchvision_postprocess(
        inputs, score_threshold, topk, iou_threshold, max_detections
    )
    for b in range(case["batch"]):
        n = int(fused[3][b])
        assert_descending(fused[1][b, :n])
        mine = tuple(t[b, :n].cpu() for t in fused[:3])
        assert_same_detections(mine, {k: v.cpu() for k, v in reference[b].items()})


@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED])
def test_postprocess_retinanet_geometry(dtype):
    inputs = make_decode_inputs(23, 2, RETINANET_LEVELS, 80, logit_mean=-5.0, max_image_size=640)
    cuda_inputs = moved(inputs, CUDA, dtype)
    fused = assert_fused_equals_composite(cuda_inputs, **POST)
    if dtype == torch.float32:
        reference = torchvision_postprocess(cuda_inputs, 0.05, 1000, 0.5, 300)
        for b in range(2):
            n = int(fused[3][b])
            assert n == 300
            mine = tuple(t[b, :n].cpu() for t in fused[:3])
            assert_same_detections(mine, {k: v.cpu() for k, v in reference[b].items()})


def test_postprocess_large_topk():
    # 15000 candidates per image: the per-image sort goes through CUB.
    inputs = moved(make_decode_inputs(24, 2, [20000, 3000], 2, logit_mean=0.0), CUDA)
    assert_fused_equals_composite(inputs, 0.05, 9000, 0.5, 2000)


def test_postprocess_no_suppression_keeps_every_candidate():
    inputs = moved(make_decode_inputs(25, 2, [500, 100], 4, logit_mean=0.0), CUDA)
    fused = retinanet_postprocess(
        **inputs,
        score_threshold=0.3,
        topk_candidates=200,
        iou_threshold=NO_SUPPRESSION,
        max_detections=10**4,
    )
    decoded = retinanet_decode(**inputs, score_threshold=0.3, topk_candidates=200)
    assert torch.equal(fused[3], (decoded[2] != -1).sum(1))


def test_postprocess_empty_batch():
    inputs = moved(make_decode_inputs(26, 0, [20, 5], 3), CUDA)
    out = retinanet_postprocess(**inputs, **POST)
    assert [tuple(t.shape) for t in out] == [(0, 300, 4), (0, 300), (0, 300), (0,)]


# Graph capture, host synchronisation, compilation


def graph_inputs(seed):
    return moved(
        make_decode_inputs(seed, 2, [4000, 1000, 250], 10, logit_mean=-2.0, max_image_size=320),
        CUDA,
    )


def nms_of(inputs):
    return retinanet_decode(**inputs, score_threshold=0.05, topk_candidates=300)


CALLS = {
    "decode": lambda i: retinanet_decode(**i, score_threshold=0.05, topk_candidates=300),
    "nms": lambda i: batched_nms(*nms_of(i), 0.5, 100),
    "postprocess": lambda i: retinanet_postprocess(
        **i, score_threshold=0.05, topk_candidates=300, iou_threshold=0.5, max_detections=100
    ),
}


@pytest.mark.parametrize("name", CALLS)
def test_cuda_graph_capture_and_replay(name):
    call = CALLS[name]
    static = graph_inputs(25)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(static)  # warm-up: the library and allocations outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call(static)
    for seed in (26, 27):
        fresh = graph_inputs(seed)
        for key, value in fresh.items():
            if torch.is_tensor(value):
                static[key].copy_(value)
        graph.replay()
        assert_equal(outputs, call(fresh))


@pytest.mark.parametrize("name", CALLS)
def test_no_host_synchronisation(name):
    inputs = graph_inputs(28)
    CALLS[name](inputs)  # the library loads, which may synchronise, before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        CALLS[name](inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_fullgraph(mode):
    inputs = graph_inputs(29)

    def postprocess(cls_logits, bbox_deltas, anchors, image_sizes):
        return torch.ops.bladesmith.retinanet_postprocess(
            cls_logits,
            bbox_deltas,
            anchors,
            inputs["level_sizes"],
            image_sizes,
            0.05,
            300,
            0.5,
            100,
        )

    args = [inputs[k] for k in ("cls_logits", "bbox_deltas", "anchors", "image_sizes")]
    compiled = torch.compile(postprocess, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records its graph on a later call
        assert_equal(compiled(*args), postprocess(*args))


def test_opcheck_on_cuda():
    inputs = graph_inputs(30)
    decode_args = (
        inputs["cls_logits"],
        inputs["bbox_deltas"],
        inputs["anchors"],
        inputs["level_sizes"],
        inputs["image_sizes"],
        0.05,
        300,
    )
    torch.library.opcheck(torch.ops.bladesmith.retinanet_decode.default, decode_args)
    torch.library.opcheck(
        torch.ops.bladesmith.retinanet_postprocess.default, (*decode_args, 0.5, 100)
    )
    torch.library.opcheck(torch.ops.bladesmith.batched_nms.default, (*nms_of(inputs), 0.5, 100))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_second_device():
    inputs = moved(make_decode_inputs(31, 2, [300, 50], 4), "cuda:1")
    fused = assert_fused_equals_composite(inputs, **POST)
    assert all(t.device == torch.device("cuda:1") for t in fused)
