"""retinanet_adapter: torchvision RetinaNet -> a fixed-shape pipeline whose
post-processing (box decode, NMS) is bladesmith's custom operators.

torchvision's post-processing has data-dependent sizes and host synchronisations, so it
breaks compiled graphs and cannot be captured in a CUDA graph; the pipeline computes the
same detections with static shapes (``bladesmith.models.retinanet``). Its outputs are
padded; the optimized module slices them back into torchvision's list of dicts.
"""

from __future__ import annotations

import torch

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped

# A trained RetinaNet on a busy image keeps more than this many candidates per level
# over the score threshold; fewer means post-processing is timed under a light load.
REALISTIC_CANDIDATES = 1000


class RetinaNetAdapter(Pass):
    """torchvision RetinaNet -> fixed-shape pipeline with bladesmith's decode + NMS ops."""

    name = "retinanet_adapter"
    enabler = True  # compilation, CUDA graphs and tracing need its fixed shapes

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        from bladesmith.models.retinanet import is_retinanet

        if candidate.padded_detections:
            return "the model is already a fixed-shape detection pipeline"
        if not is_retinanet(candidate.module):
            return f"{type(candidate.module).__name__} is not a torchvision RetinaNet"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        from bladesmith import ops
        from bladesmith.errors import OpsBuildError
        from bladesmith.models.retinanet import RetinaNetPipeline

        image_size = _single_image_size(context.test_args)
        try:
            with context.step("building bladesmith's custom operators"):
                ops.load_library()
        except OpsBuildError as error:
            raise PassSkipped(f"bladesmith's custom operators are unavailable: {error}") from error
        pipeline = RetinaNetPipeline(candidate.module, image_size).to(context.device)
        adapted = candidate.with_module(pipeline, self.name, padded_detections=True)
        batch = adapted.runner_args(context.example_args)[0]
        num_classes = pipeline.head.classification_head.num_classes
        capacity = [size * num_classes for size in pipeline.level_sizes]
        context.notes.append(_load_note(pipeline.candidates_per_level(batch), capacity))
        return adapted


def _single_image_size(test_args: list[tuple]) -> tuple[int, int]:
    sizes = set()
    for args in test_args:
        images = args[0] if args else None
        if isinstance(images, torch.Tensor) and images.dim() == 3:
            raise PassSkipped(
                "test_data: a detector takes a list of images [3, H, W] (or a batch "
                f"[B, 3, H, W]); got one tensor of shape {list(images.shape)}"
            )
        if not isinstance(images, (list, tuple, torch.Tensor)) or len(images) == 0:
            raise PassSkipped("test_data: expected (images,) with a non-empty list of images")
        sizes.update(tuple(image.shape[-2:]) for image in images)
    if len(sizes) != 1:
        raise PassSkipped(
            f"test_data has images of several sizes {sorted(sizes)}; the fixed-shape "
            "pipeline is built for one: optimize once per size"
        )
    return sizes.pop()


def _load_note(per_level: list[int], capacity: list[int]) -> str:
    """Whether post-processing works as hard as for a trained model on a busy image:
    at least 1,000 candidates on each level (or all of a level's anchors x classes)."""
    counts = ", ".join(f"{n:,}" for n in per_level)
    if all(n >= min(REALISTIC_CANDIDATES, c) for n, c in zip(per_level, capacity)):
        verdict = (
            f"at least {REALISTIC_CANDIDATES:,} on every level (or all its anchors), a "
            "trained model's load on a busy image: post-processing is timed under "
            "realistic load"
        )
    else:
        verdict = (
            f"fewer than {REALISTIC_CANDIDATES:,} on some level: post-processing is timed "
            "under a lighter load than a trained model's on a busy image (random weights? "
            "build_retinanet(realistic_load=True) calibrates them)"
        )
    return f"RetinaNet candidates over the score threshold per level: {counts}; {verdict}"
