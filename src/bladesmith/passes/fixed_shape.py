"""fixed_shape: a model that a family recognises -> the family's fixed-shape pipeline.

A detector's post-processing (box decode, NMS) has data-dependent sizes and host
synchronisations, so it breaks compiled graphs and cannot be captured in a CUDA graph;
the family's pipeline computes the same outputs with static shapes, padded. The
optimized module turns them back into the model's own structure (``Family.to_user``).
"""

from __future__ import annotations

import torch

from bladesmith.families import family_of
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped
from bladesmith.typed_outputs import PlainOutputs


class FixedShape(Pass):
    """A model of a known family -> its fixed-shape pipeline (bladesmith's operators)."""

    name = "fixed_shape"
    enabler = True  # compilation, CUDA graphs and tracing need its fixed shapes

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if candidate.family is not None:
            return "the model is already a fixed-shape pipeline"
        if family_of(candidate.module) is None:
            model = candidate.module
            if isinstance(model, PlainOutputs):  # named as the user knows it
                model = model.model
            return f"no family of bladesmith.families recognises {type(model).__name__}"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        from bladesmith import ops
        from bladesmith.errors import OpsBuildError

        family = family_of(candidate.module)
        image_size = _single_image_size(context.test_args)
        try:
            with context.step("building bladesmith's custom operators"):
                ops.load_library()
        except OpsBuildError as error:
            raise PassSkipped(f"bladesmith's custom operators are unavailable: {error}") from error
        pipeline = family.adapt(candidate.module, image_size).to(context.device)
        adapted = candidate.with_module(pipeline, self.name, family=family)
        note = family.load_note(pipeline, adapted.runner_args(context.example_args)[0])
        if note:
            context.notes.append(note)
        return adapted

    def saving_form(self, candidate: Candidate, context: Context) -> Candidate | None:
        """The pipeline around the result's module (its weights as the other passes left
        them), where this pass was dropped (slower than the model's own post-processing:
        on a CPU, often) and the result is the model's module, run as itself."""
        if candidate.runner is not None or self.skip_reason(candidate, context) is not None:
            return None
        try:
            image_size = _single_image_size(context.test_args)
        except PassSkipped:
            return None
        pipeline = family_of(candidate.module).adapt(candidate.module, image_size)
        return candidate.with_module(
            pipeline.to(context.device), self.name, family=family_of(candidate.module)
        )


def _single_image_size(test_args: list[tuple]) -> tuple[int, int]:
    sizes = set()
    for args in test_args:
        images = args[0] if args else None
        if isinstance(images, torch.Tensor) and images.dim() == 3:
            raise PassSkipped(
                "test_data: the model takes a list of images [3, H, W] (or a batch "
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
