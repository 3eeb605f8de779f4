"""What bladesmith knows about a kind of model: a family.

A family recognises a model (``detects``), adapts it to a fixed-shape pipeline
(``adapt``: no data-dependent shapes, no host synchronisation, so the whole pipeline
compiles, exports and captures in one CUDA graph), turns the pipeline's padded outputs
back into the model's own structure (``to_user``) and compares two outputs of that kind
(``compare``). The engine, candidates, spec, artifacts and verification ask the family
of a model and name none themselves; ``bladesmith.families`` lists the families.
"""

from __future__ import annotations

import torch
from torch import nn

from bladesmith.images import as_batch
from bladesmith.verify import Comparison, compare_outputs


class Family:
    """A kind of model. Subclasses set ``name`` and ``output_names`` and implement
    ``detects``, ``adapt`` and ``to_user``."""

    name: str  # "retinanet", ...
    output_names: tuple[str, ...]  # the pipeline's padded outputs, in order
    user_output: str = "as the model"  # what ``to_user`` returns, for ``Spec.output``

    def detects(self, model) -> bool:
        """Whether ``model`` (the user's, as given) is of this family."""
        raise NotImplementedError(f"family {self.name} does not implement detects()")

    def adapt(self, model: nn.Module, image_size: tuple[int, int]) -> nn.Module:
        """The fixed-shape pipeline of ``model`` for images of ``image_size``:
        ``forward(images [B, 3, H, W] float) -> tuple of padded tensors`` named by
        ``output_names``. It shares ``model``'s parameters and modifies none."""
        raise NotImplementedError(f"family {self.name} does not implement adapt()")

    def to_user(self, outputs: tuple):
        """The pipeline's padded ``outputs`` in the model's own structure."""
        raise NotImplementedError(f"family {self.name} does not implement to_user()")

    def compare(self, reference, candidate, **tolerances) -> Comparison:
        """Outputs in the model's own structure against the reference's
        (``verify.compare_outputs``'s keywords)."""
        return compare_outputs(reference, candidate, **tolerances)

    def load_note(self, pipeline: nn.Module, batch: torch.Tensor) -> str | None:
        """A line for the report: is post-processing timed under real load?"""
        return None

    def pipeline_args(self, user_args: tuple) -> tuple:
        """The pipeline's inputs for the user's call ``model(*user_args)``: one batch
        [B, 3, H, W] of the images (a list of images of one size, or a batch)."""
        images = user_args[0]
        if not (isinstance(images, torch.Tensor) and images.dim() == 4):
            shapes = {tuple(image.shape) for image in images}
            if len(shapes) > 1:
                raise ValueError(
                    "images: expected images of one size (the size the model was optimized "
                    f"for), got sizes {sorted(shapes)}"
                )
        return (as_batch(images),)

    def user_args(self, batch: torch.Tensor) -> tuple:
        """The user's call for a batch of images: the list of them."""
        return (list(batch),)

    def user_form(self, pipeline) -> nn.Module:
        """The drop-in module: the user's call and outputs around ``pipeline`` (any
        callable with the pipeline's inputs and padded outputs)."""
        return UserForm(self, pipeline)


class UserForm(nn.Module):
    """A family's pipeline called as the model is and returning what the model returns."""

    def __init__(self, family: Family, pipeline):
        super().__init__()
        self.family = family
        self.pipeline = pipeline

    def forward(self, *args):
        return self.family.to_user(self.pipeline(*self.family.pipeline_args(args)))


class DetectionFamily(Family):
    """A detector: padded (boxes [B, D, 4], scores [B, D], labels [B, D] int64 (-1 =
    padding), num_detections [B] int64), and torchvision's list of {boxes, scores,
    labels} dicts for the user, compared by ``verify``'s detection matching."""

    output_names = ("boxes", "scores", "labels", "num_detections")
    user_output = "detections"  # torchvision's list of {boxes, scores, labels} dicts

    def to_user(self, outputs: tuple) -> list[dict[str, torch.Tensor]]:
        """One dict per image, sliced by num_detections (one host synchronisation, after
        all the device work); boxes and scores in float32."""
        boxes, scores, labels, num_detections = outputs[:4]
        # Converted before the host waits for the counts, while the device still works.
        boxes, scores = _as_float32(boxes), _as_float32(scores)
        return [
            {"boxes": boxes[i, :n], "scores": scores[i, :n], "labels": labels[i, :n]}
            for i, n in enumerate(num_detections.tolist())
        ]


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


class DetectionsAsList(UserForm):
    """The drop-in form of a padded detector: ``forward(images: list[Tensor]) ->
    list[dict(boxes, scores, labels)]``, as torchvision's detectors return in eval mode.
    ``padded`` maps a batch [B, 3, H, W] to (boxes, scores, labels, num_detections)."""

    def __init__(self, padded):
        super().__init__(DetectionFamily(), padded)
