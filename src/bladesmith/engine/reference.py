"""The reference: the model as given, its outputs on the test inputs, and the same under
rounding noise, against which every candidate is verified: the spread of its float32
outputs under float32 rounding sets their tolerance (``verify.tolerance``), a detector's
detections under fp16/TF32 rounding say which flips rounding alone makes."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from bladesmith.config import Config
from bladesmith.errors import describe
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context
from bladesmith.verify import (
    Comparison,
    DetectionComparison,
    NoiseTolerances,
    compare_outputs,
    contains_detections,
    default_tolerance,
    detection_score_tolerance,
    dtype_name,
    noise_tolerances,
    precisions,
    rounding_unit,
    tensor_paths,
)
from bladesmith.verify.fields import MEASURES, FieldDeviation
from bladesmith.verify.tolerance import (
    HALF_NOISE_MARGIN,
    NOISE_MARGIN,
    NOISE_RUNS,
    TF32_NOISE,
)

# Rounding noise to probe a detector with: each weight moved by about float16's (and
# TF32's) unit roundoff, 2^-11 of itself.
ROUNDING_NOISE = TF32_NOISE
# Unmatched detections of a noisy run (the other runs' flips excused) from which a
# model counts as chaotic and is judged at its own F1: Faster R-CNN with random weights
# leaves 12-17 of 200; a model with one borderline detection leaves 1.
CHAOTIC_MISMATCHES = 3
# The self-agreement (the lowest F1 of the model's detections under rounding noise
# against its own) below which the gate cannot tell a right result from a wrong one:
# past it, rounding alone changes most of what the model detects, and a floor that
# excuses that excuses a wrong pass as well. Mask R-CNN with random weights and a score
# threshold of 0.005 keeps near-tied detections on any image: F1 0.02 on a 480x640
# uniform-noise image on an H100; on the CPU at 240x320, 0.76 there and 0.41 on a
# photograph.
MIN_SELF_AGREEMENT = 0.5


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
    """The model's outputs on the test inputs, compared by its family (``family``, when
    one recognised the model). It holds the tolerances of its float32 tensor outputs,
    measured under float32 rounding noise (unless ``Config.atol`` sets them). For outputs
    that rounding can flip (detections) it holds the same outputs under rounding noise:
    what rounding alone flips is not held against a pass (run the first time a comparison
    fails without)."""

    def __init__(self, outputs: list, given: Candidate, context: Context, family=None):
        self.outputs, self.model, self.context, self.family = outputs, given.module, context, family
        self.inputs = context.test_args  # what ``outputs`` answer
        self.dtype = given.dtype  # what the model as given computes in
        self.flips = family is not None or contains_detections(outputs)
        self._noisy: list | None = None
        self._floor: tuple | None | bool = False  # False: not yet measured
        self._says_floor = True  # the held-out copy's floor follows the note this one gave
        # Why these inputs cannot verify a change of arithmetic (the model does not
        # reproduce its own answer under rounding noise), once the noise runs found it.
        self.unverifiable = ""
        self.self_agreement: float | None = None  # that F1, once measured
        self._measured: dict[torch.dtype, NoiseTolerances | None] = {}
        # A held-out copy's: the test data's reference and the test input each call was
        # derived from, whose measured tolerances judge it (``on``).
        self._judged_as: tuple[Reference, list[int]] | None = None
        self.measured = None if context.config.atol is not None else self._measure(self.dtype)

    def on(self, inputs: list[tuple], outputs: list, sources: list[int]) -> Reference:
        """The model's ``outputs`` on other ``inputs`` (held-out ones), each judged at the
        tolerances measured on the test input it was derived from (``sources``: its
        index in the test data), however many there are of each."""
        other = copy.copy(self)
        other.inputs, other.outputs = inputs, outputs
        other.flips = self.family is not None or contains_detections(outputs)
        other._noisy, other._floor, other._says_floor = None, False, False
        other._judged_as = (self, sources)
        other.unverifiable, other.self_agreement = "", None
        return other

    def _measure(self, dtype: torch.dtype) -> NoiseTolerances | None:
        """The tolerances of outputs computed in ``dtype`` (the model's own, or a 16-bit
        type of the precision passes), from the model under that arithmetic's rounding noise;
        None when it has no floating-point tensor output (detections are matched) or
        cannot be copied (the fixed default then applies, and a note says why)."""
        if dtype in self._measured:
            return self._measured[dtype]
        outputs = {p: t for p, t in tensor_paths(self.outputs) if t.is_floating_point()}
        config, device = self.context.config, self.context.device
        result = None
        if outputs:
            if dtype in (torch.float32, torch.float64):
                unit, unit_name = rounding_unit(device, self.model, dtype)
                rtol, margin = default_tolerance(dtype)[0], NOISE_MARGIN
            else:
                precision = precisions.of_dtype(dtype)  # its rounding, as it declares
                unit, unit_name = precision.noise_unit, precision.name
                rtol, margin = default_tolerance(dtype)[0], HALF_NOISE_MARGIN
            rtol = config.rtol if config.rtol is not None else rtol
            try:
                with self.context.step(
                    f"running the model as given under {dtype_name(dtype)} rounding noise"
                ):
                    runs = reference_under_noise(
                        self.model, self.inputs, runs=NOISE_RUNS, relative=unit
                    )
            except Exception as error:
                self.context.notes.append(f"tolerance: not measured ({describe(error)})")
            else:
                result = noise_tolerances(
                    outputs,
                    [dict(tensor_paths(run)) for run in runs],
                    rtol,
                    unit,
                    unit_name,
                    margin=margin,
                    computed_in=dtype_name(dtype),
                )
        self._measured[dtype] = result
        return result

    def _measured_for(self, dtype: torch.dtype) -> NoiseTolerances | None:
        """The measured tolerances that judge outputs computed in ``dtype``: the model's
        own dtype's and, unless the outputs are detections (matched by their family's
        rules), the 16-bit types' (measured on first use); none where Config sets atol.
        A held-out copy's are the test data's, each call's its source's."""
        if self._judged_as is not None:
            test, sources = self._judged_as
            measured = test._measured_for(dtype)
            return None if measured is None else _for_calls(measured, sources, self.outputs)
        if self.measured is None:
            return None
        if dtype == self.dtype:
            return self.measured
        if dtype in (torch.float16, torch.bfloat16) and not self.flips:
            return self._measure(dtype)
        return None

    def tolerance(self, dtype: torch.dtype, config: Config) -> dict:
        """The tolerance outputs computed in ``dtype`` are judged at: rtol, atol (the
        largest, where it is measured per output) and why."""
        measured = self._measured_for(dtype)
        if measured is not None:
            return measured.to_dict()
        rtol, atol = default_tolerance(dtype)
        if config.rtol is not None or config.atol is not None:
            rtol = config.rtol if config.rtol is not None else rtol
            atol = config.atol if config.atol is not None else atol
            why = f"Config(rtol={rtol:g}, atol={atol:g})"
        else:
            why = f"the default for {dtype_name(dtype)} outputs"
        return {"rtol": rtol, "atol": atol, "why": why}

    def noisy(self) -> list:
        if self._noisy is None:
            try:
                with self.context.step("running the model as given under rounding noise"):
                    self._noisy = reference_under_noise(self.model, self.inputs)
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
        """``outputs`` (on the test inputs) against the model's, at ``tolerance``'s;
        a detector's with the noisy runs when that fails, and, for a model whose own
        detections rounding alone moves past the gate (``noise_floor``), at that floor."""
        tolerance = self.tolerance(dtype, config)
        rtol, atol = tolerance["rtol"], tolerance["atol"]
        measured = self._measured_for(dtype)
        score_atol = detection_score_tolerance(dtype, rtol + atol)

        by = self.family.compare if self.family is not None else compare_outputs

        def compare(
            candidate, noisy, min_f1=config.min_f1, scores=score_atol, fields=None
        ) -> Comparison:
            return by(
                self.outputs,
                candidate,
                noisy=noisy,
                rtol=rtol,
                atol=atol,
                tolerances=measured.tolerances if measured else None,
                iou_threshold=config.iou_threshold,
                min_f1=min_f1,
                score_atol=scores,
                field_tolerances=fields,
                inputs=self.inputs,
                allow_degenerate=config.allow_degenerate,
                computed_in=dtype,
                source=tolerance["why"],
            )

        comparison = compare(outputs, ())
        if not self.flips or comparison.passed:
            return comparison
        comparison = compare(outputs, self.noisy())
        if not comparison.passed:
            floor = self.noise_floor(compare, config, score_atol)
            if floor is not None:
                comparison = compare(outputs, self.noisy(), *floor)
        # Passed on rounding's excuses: they prove nothing where rounding changes most of
        # what the model answers.
        if comparison.passed and self._spread(compare, config) and self.unverifiable:
            comparison.unverified = self.unverifiable
        return comparison

    def noise_floor(self, compare, config: Config, score_atol: float):
        """(F1, score deviation, tolerances of the other fields by measure) at which a
        candidate is judged when rounding alone moves the model's detections past the
        gate: each noisy run against the model, the others' flips excused, reaches at
        worst F1 ``f1`` with matched scores moved up to ``scores`` and each other field
        (masks, keypoints: ``verify.fields``) as far as it moved. A candidate may then
        go that far (no further from the model than rounding alone moves it). In F1 it
        may only when the runs differ from the model in ``CHAOTIC_MISMATCHES`` detections
        or more: a borderline detection or two that rounding flips is the excuses'
        business, and a floor set by one flip would excuse any other. In scores and the
        other fields it may whenever they moved past their tolerance. None when the model
        is steadier than the gate."""
        if not self._spread(compare, config):
            return None
        f1, mismatches, scores, spread = self._floor
        chaotic = f1 < config.min_f1 and mismatches >= CHAOTIC_MISMATCHES
        # Each field at its own spread where that is past its tolerance (the default at
        # this dtype's score tolerance, not at a score floor).
        fields = {
            name: FieldDeviation(
                name, MEASURES[name].default(config.iou_threshold, score_atol), worst
            )
            for name, worst in spread.items()
        }
        moved = [field for field in fields.values() if not field.passed]
        if not chaotic and scores <= score_atol and not moved:
            return None
        floor = (
            min(f1, config.min_f1) if chaotic else config.min_f1,
            max(scores, score_atol),
            {name: max(field.tolerance, field.deviation) for name, field in fields.items()},
        )
        note = (
            f"detections: rounding alone moves this model's detections past the gate (F1 "
            f"{f1:.4g} against its own, {mismatches} detections unmatched, matched scores "
            f"moved up to {scores:.2g}"
            + "".join(f", {field.summary()}" for field in moved)
            + f"): passes are judged at that floor, F1 >= {floor[0]:.4g} and scores within "
            f"{floor[1]:.2g}"
            + (f", {', '.join(field.name for field in moved)} as far" if moved else "")
            + ", so a change of arithmetic is told from a wrong pass only as far as the "
            "model's own noise allows"
        )
        if self._says_floor and note not in self.context.notes:
            self.context.notes.append(note)
        return floor

    def _spread(self, compare, config: Config) -> bool:
        """Whether the noisy runs' spread against the model (``_own_spread``) is known,
        measured on first use, with the self-agreement it gives and, where that is below
        ``MIN_SELF_AGREEMENT`` (and past the gate in ``CHAOTIC_MISMATCHES`` detections or
        more), why these inputs cannot verify a change of arithmetic."""
        if self._floor is False:
            self._floor = self._own_spread(compare)
            if self._floor is not None:
                f1, mismatches = self._floor[:2]
                self.self_agreement = f1
                if f1 < min(config.min_f1, MIN_SELF_AGREEMENT) and (
                    mismatches >= CHAOTIC_MISMATCHES
                ):
                    self.unverifiable = (
                        "the model as given does not reproduce its own detections on these "
                        "inputs: with its weights moved by rounding noise it agrees with "
                        f"itself at F1 {f1:.3g} ({mismatches} detections unmatched), below "
                        f"{MIN_SELF_AGREEMENT:g}, so the gate cannot tell a right result "
                        "from a wrong one"
                    )
        return self._floor is not None

    def _own_spread(self, compare) -> tuple[float, int, float, dict[str, float]] | None:
        """(lowest F1, most unmatched detections, largest matched score deviation, each
        other field's largest deviation by measure) of the noisy runs against the model,
        each with the others' flips excused; None with fewer than two runs."""
        runs = self.noisy()
        found = []
        for index, run in enumerate(runs):
            others = runs[:index] + runs[index + 1 :]
            outputs = compare(run, others).outputs.values()
            found += [o for o in outputs if isinstance(o, DetectionComparison)]
        if len(runs) < 2 or not found:
            return None
        spread: dict[str, float] = {}
        for d in found:
            for name, field in d.fields.items():
                spread[name] = max(spread.get(name, 0.0), field.deviation or 0.0)
        return (
            min(d.f1 for d in found),
            max(d.reference_count + d.candidate_count - 2 * d.matched for d in found),
            max(d.max_score_deviation or 0.0 for d in found),
            spread,
        )


def _for_calls(measured: NoiseTolerances, sources: list[int], outputs: list) -> NoiseTolerances:
    """``measured`` (keyed by the test calls' paths, "out[3]['logits']") for other calls:
    each output of call ``i`` of ``outputs`` at the tolerance of the same output of test
    call ``sources[i]``; an output that call lacks is judged at the overall rtol and atol."""
    tolerances = {}
    for call, source in enumerate(sources):
        own, theirs = f"out[{call}]", f"out[{source}]"
        for path, _ in tensor_paths(outputs[call], own):
            tolerance = measured.tolerances.get(theirs + path.removeprefix(own))
            if tolerance is not None:
                tolerances[path] = tolerance
    return dataclasses.replace(measured, tolerances=tolerances)
