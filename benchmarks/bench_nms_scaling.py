"""How batched_nms's CUDA kernels scale: device time per kernel as the number of
candidates, the detections kept and the overlap change (torch.profiler), to see which
part of the operator costs what. Also prints the SM clock the GPU runs at.

    python benchmarks/bench_nms_scaling.py
"""

from __future__ import annotations

import torch
from torchvision.models.detection import retinanet_resnet50_fpn

from bench_postprocess import DETECTIONS, IMAGE, IOU, THRESHOLD, TOPK, realistic_inputs
from bladesmith.ops import batched_nms, load_library, retinanet_decode
from gpu_probe import effective_mhz, kernel_times


def clustered(count: int, per_cluster: int, device) -> tuple:
    """Candidates in tight same-class clusters (a trained model's many boxes per object):
    NMS suppresses most of them."""
    g = torch.Generator(device=device).manual_seed(0)
    centres = torch.rand(count // per_cluster, 2, generator=g, device=device) * 600
    centres = centres.repeat_interleave(per_cluster, 0)
    jitter = torch.randn(len(centres), 4, generator=g, device=device) * 3
    boxes = torch.cat([centres - 20, centres + 20], 1) + jitter
    scores = torch.rand(len(centres), generator=g, device=device)
    labels = torch.randint(0, 80, (count // per_cluster,), generator=g, device=device)
    labels = labels.repeat_interleave(per_cluster)
    return boxes[None], scores[None], labels[None]


def photograph(device) -> tuple:
    """The decoded candidates of bladesmith's realistic-load RetinaNet R50-FPN on a
    photograph: its scores vary smoothly over the image, so boxes of one class overlap in
    clusters, as a trained model's do around objects."""
    from bladesmith.families.retinanet import RetinaNetPipeline
    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    pipeline = RetinaNetPipeline(build_retinanet(IMAGE), IMAGE).to(device)
    cls_logits, bbox_deltas = pipeline.head_outputs(sample_images(1, IMAGE, device=device))
    return retinanet_decode(
        cls_logits,
        bbox_deltas,
        pipeline.anchors,
        pipeline.level_sizes,
        pipeline.resized_hw,
        score_threshold=THRESHOLD,
        topk_candidates=TOPK,
    )


def grid(count: int, num_labels: int, device) -> tuple:
    """Boxes on a grid that never overlap, labels cycling over ``num_labels``: NMS keeps
    every one, after comparing each with the kept boxes of its label."""
    side = int(count**0.5) + 1
    i = torch.arange(count, device=device)
    corners = torch.stack([i % side, i // side], 1).float() * 20
    boxes = torch.cat([corners, corners + 10], 1)
    scores = torch.linspace(1, 0.1, count, device=device)
    return boxes[None], scores[None], (i % num_labels)[None]


def main() -> None:
    device = torch.device("cuda")
    load_library()
    print(f"SM clock: {effective_mhz():.0f} MHz")
    model = retinanet_resnet50_fpn(weights=None, weights_backbone=None, num_classes=80).eval()
    with torch.inference_mode():
        inputs = realistic_inputs(model, 1, device, torch.float32, seed=0)
        boxes, scores, labels = retinanet_decode(
            **inputs, score_threshold=THRESHOLD, topk_candidates=TOPK
        )
        cases = []
        for count in (256, 1024, 5000):
            for detections in (1, 50, DETECTIONS):
                cases.append(
                    (
                        f"decoded, {count} candidates, keep {detections}",
                        boxes[:, :count],
                        scores[:, :count],
                        labels[:, :count],
                        detections,
                    )
                )
        for count in (64, 128, 256, 512, 1024):
            for num_labels in (count, 1):
                cases.append(
                    (
                        f"grid, {count} candidates, {num_labels} labels, keep all",
                        *grid(count, num_labels, device),
                        count,
                    )
                )
        for per_cluster in (10, 100):
            cases.append(
                (
                    f"clusters of {per_cluster}, 5000 candidates, keep {DETECTIONS}",
                    *clustered(5000, per_cluster, device),
                    DETECTIONS,
                )
            )
        cases.append(
            (f"RetinaNet on a photograph, keep {DETECTIONS}", *photograph(device), DETECTIONS)
        )
        for name, b, s, lab, d in cases:
            times = kernel_times(lambda: batched_nms(b, s, lab, IOU, d))  # noqa: B023
            kept = int(batched_nms(b, s, lab, IOU, d)[3][0])
            text = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
            print(f"{name} (kept {kept}): {text} us")
    print(f"SM clock after: {effective_mhz():.0f} MHz")


if __name__ == "__main__":
    main()
