"""The reference: the model as given, its outputs on the test inputs, and the same under
rounding noise, against which every candidate is verified."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from bladesmith.config import Config
from bladesmith.errors import describe
from bladesmith.passes.registry import Context
from bladesmith.verify import (
    Comparison,
    compare_outputs,
    contains_detections,
    default_tolerance,
    detection_score_tolerance,
)

# Rounding noise to probe a model with: each weight moved by about float16's (and TF32's)
# unit roundoff, 2^-11 of itself.
ROUNDING_NOISE = 2.0**-11


@torch.no_grad()
def reference_under_noise(
    model: torch.nn.Module, inputs: Sequence[tuple], runs: int = 2, relative: float = ROUNDING_NOISE
) -> list[list]:
    """The outputs of ``model`` on each of ``inputs`` (argument tuples) in ``runs`` runs,
    each with a copy whose floating-point parameters are multiplied by 1 + ``relative``
    times a standard normal draw (seeded: the same runs every call). What differs from
    the model's own outputs is what rounding alone can flip. ``model`` is untouched."""
    results = []
    for run in range(runs):
        noisy = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(run)
        for parameter in noisy.parameters():
            if parameter.is_floating_point():
                draw = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
                parameter.mul_((1 + relative * draw).to(parameter))
        results.append([noisy(*args) for args in inputs])
        del noisy
    return results


class Reference:
    """The model's outputs on the test inputs and, for a detector, the same under
    rounding noise: the detections that rounding alone flips are not held against a
    pass. The noisy runs are made the first time a comparison fails without them."""

    def __init__(self, outputs: list, model: nn.Module, context: Context):
        self.outputs, self.model, self.context = outputs, model, context
        self.detects = contains_detections(outputs)
        self._noisy: list | None = None

    def noisy(self) -> list:
        if self._noisy is None:
            try:
                with self.context.step("running the model as given under rounding noise"):
                    self._noisy = reference_under_noise(self.model, self.context.test_args)
                self.context.notes.append(
                    f"detections: the model as given ran {len(self._noisy)} more times with "
                    "its weights moved by rounding noise; what that alone flips is not held "
                    "against a pass (each pass's accuracy counts what it excused)"
                )
            except Exception as error:  # a model that cannot be copied is judged without
                self.context.notes.append(f"no rounding-noise runs ({describe(error)})")
                self._noisy = []
        return self._noisy

    def compare(self, outputs, dtype: torch.dtype, config: Config) -> Comparison:
        """``outputs`` (on the test inputs) against the model's, at the tolerances of
        ``dtype`` unless ``config`` sets them; with the noisy runs when that fails."""
        rtol, atol = default_tolerance(dtype)
        rtol = config.rtol if config.rtol is not None else rtol
        atol = config.atol if config.atol is not None else atol

        def compare(noisy) -> Comparison:
            return compare_outputs(
                self.outputs,
                outputs,
                noisy=noisy,
                rtol=rtol,
                atol=atol,
                iou_threshold=config.iou_threshold,
                min_f1=config.min_f1,
                score_atol=max(rtol + atol, detection_score_tolerance(dtype)),
            )

        comparison = compare(())
        return compare(self.noisy()) if self.detects and not comparison.passed else comparison
