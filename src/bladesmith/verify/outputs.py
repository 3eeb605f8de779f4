"""Any structure of outputs compared with the reference's: tensors, sequences, dicts and
detection lists, each by its own comparator, reported by path, each with where its
tolerance comes from (``Comparison.sources``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from bladesmith.typed_outputs import plain
from bladesmith.verify._format import dtype_name, finite_or_none
from bladesmith.verify.boxes import box_rule, largest_image_size, looks_like_boxes
from bladesmith.verify.degenerate import TENSOR_LIKE, degenerate_reasons
from bladesmith.verify.detections import DetectionComparison, compare_detections, is_detection_list
from bladesmith.verify.tensors import TensorComparison, compare_tensors
from bladesmith.verify.tolerance import Tolerance, is_half, spread_ceiling


@dataclass
class Comparison:
    """Every output of a model against the reference's, by path ("out[0]['boxes']").

    ``degenerate`` says why the comparison has nothing to compare (non-finite inputs or
    reference outputs, no output, every output empty or zero, no detection): such a
    comparison does not pass unless ``allow_degenerate``, the user's consent.
    ``unverified`` says why a comparison that passed proves nothing: the reference
    itself moved as far under rounding noise (``engine.reference``), so the gate it
    passed would have admitted a wrong answer too.
    """

    outputs: dict[str, TensorComparison | DetectionComparison] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # structure mismatches, by path
    degenerate: list[str] = field(default_factory=list)
    allow_degenerate: bool = False
    unverified: str = ""

    @property
    def passed(self) -> bool:
        if self.degenerate and not self.allow_degenerate:
            return False
        return not self.reasons and all(output.passed for output in self.outputs.values())

    @property
    def tolerance_ratio(self) -> float:
        """The worst output's error over its tolerance: > 1 is past it."""
        ratios = [output.tolerance_ratio for output in self.outputs.values()]
        return math.inf if self.reasons else max(ratios, default=0.0)

    def failures(self) -> list[str]:
        nothing = []
        if self.degenerate and not self.allow_degenerate:
            nothing = [
                f"nothing to compare ({'; '.join(self.degenerate)}); "
                "Config(allow_degenerate=True) accepts it"
            ]
        return [*nothing, *self.reasons] + [
            f"{path}: {output.summary()}"
            for path, output in self.outputs.items()
            if not output.passed
        ]

    def summary(self) -> str:
        failures = self.failures()
        if failures:
            shown = "; ".join(failures[:3])
            return shown + (f"; and {len(failures) - 3} more" if len(failures) > 3 else "")
        if self.degenerate:  # accepted by the user: say so all the same
            return f"accepted with nothing to compare ({'; '.join(self.degenerate)})"
        if len(self.outputs) == 1:
            return next(iter(self.outputs.values())).summary()
        path, closest = max(self.outputs.items(), key=lambda item: item[1].tolerance_ratio)
        # The closest's summary names its own; the others' are named here.
        unverified = [
            f"{other}[{key!r}]"
            for other, output in self.outputs.items()
            if other != path and isinstance(output, DetectionComparison)
            for key in output.unverified
        ]
        return (
            f"all {len(self.outputs)} outputs within tolerance; closest to its limit "
            f"{path}: {closest.summary()}"
        ) + (f"; not verified: {', '.join(unverified)} (no measure)" if unverified else "")

    def sources(self) -> dict[str, list[str]]:
        """Where each output's tolerance comes from: {source: the paths judged by it}."""
        found: dict[str, list[str]] = {}
        for path, output in self.outputs.items():
            found.setdefault(output.source, []).append(path)
        return found

    def to_dict(self) -> dict:
        return {
            "kind": "outputs",
            "passed": self.passed,
            "summary": self.summary(),
            "tolerance_ratio": finite_or_none(self.tolerance_ratio),
            "reasons": list(self.reasons),
            "degenerate": list(self.degenerate),
            "unverified": self.unverified,
            "outputs": {path: output.to_dict() for path, output in self.outputs.items()},
            "sources": self.sources(),
        }


def compare_outputs(
    reference,
    candidate,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: Mapping[str | int, Tolerance] | None = None,
    iou_threshold: float = 0.9,
    min_f1: float = 0.99,
    score_atol: float | None = None,
    field_tolerances: Mapping[str, float] | None = None,
    noisy: Sequence = (),
    name: str = "out",
    inputs=None,
    allow_degenerate: bool = False,
    computed_in: torch.dtype | None = None,
    source: str | None = None,
    image_size: tuple[int, int] | None = None,
) -> Comparison:
    """Compare a model's outputs with the reference's, whatever their structure.

    Tensors (and numbers, numpy arrays) are compared with ``compare_tensors``; tuples,
    lists and dicts recursively; a list of {"boxes", "scores", "labels"} dicts with
    ``compare_detections``. ``rtol``/``atol`` override the dtype defaults for every
    tensor; ``tolerances`` overrides them per output, keyed by its full path
    ("out[1]", "out['logits']") or its last index or key (1, "logits"); the full path
    wins. A key that names no output is an error, so a typo cannot go unnoticed.
    ``noisy``: the reference model's outputs under rounding noise, structured like
    ``reference`` (``engine.reference.reference_under_noise``), and ``field_tolerances``
    (masks, keypoints, ... by measure name), for ``compare_detections``.
    ``inputs``: what the outputs were computed from, checked for NaN and inf. A
    comparison on nothing (``Comparison.degenerate``) fails unless ``allow_degenerate``.

    Integer and bool tensors must be equal. A detector's boxes (``verify.boxes``) keep
    IoU >= ``iou_threshold`` row by row and move no more than that rule allows in an
    image of ``image_size`` (width, height; by default the largest image in
    ``inputs``). Outputs ``computed_in`` float16 or bfloat16 move no more than
    ``HALF_SPREAD_CEILING`` of their reference's range. ``source`` says where ``rtol``
    and ``atol`` come from (a ``Tolerance``'s own source wins). Dataclasses and
    NamedTuples are compared as the dicts and tuples they hold (``typed_outputs.plain``).
    """
    reference, candidate = plain(reference), plain(candidate)
    tolerances = dict(tolerances or {})
    result = Comparison(allow_degenerate=allow_degenerate)
    used: set = set()
    if image_size is None:
        image_size = largest_image_size(inputs)

    def visit(path: str, last, ref, cand, noisy: list, siblings=()) -> None:
        if is_detection_list(ref):
            result.outputs[path] = compare_detections(
                ref,
                cand,
                iou_threshold=iou_threshold,
                min_f1=min_f1,
                score_atol=score_atol,
                field_tolerances=field_tolerances,
                noisy=noisy,
                image_size=image_size,
            )
        elif isinstance(ref, Mapping):
            if not isinstance(cand, Mapping):
                result.reasons.append(f"{path}: expected a dict, got {type(cand).__name__}")
            elif set(ref) != set(cand):
                result.reasons.append(
                    f"{path}: keys {sorted(map(str, cand))} differ from the reference's "
                    f"{sorted(map(str, ref))}"
                )
            else:
                for key in ref:
                    others = [value for other, value in ref.items() if other != key]
                    visit(
                        f"{path}[{key!r}]",
                        key,
                        ref[key],
                        cand[key],
                        [n[key] for n in noisy],
                        others,
                    )
        elif isinstance(ref, (list, tuple)):
            if not isinstance(cand, (list, tuple)):
                result.reasons.append(f"{path}: expected a sequence, got {type(cand).__name__}")
            elif len(ref) != len(cand):
                result.reasons.append(f"{path}: {len(cand)} items, the reference has {len(ref)}")
            else:
                for index, (r, c) in enumerate(zip(ref, cand, strict=True)):
                    others = [*ref[:index], *ref[index + 1 :]]
                    visit(f"{path}[{index}]", index, r, c, [n[index] for n in noisy], others)
        elif isinstance(ref, TENSOR_LIKE):
            if not isinstance(cand, TENSOR_LIKE):
                result.reasons.append(f"{path}: expected a tensor, got {type(cand).__name__}")
                return
            keys = [key for key in (path, last) if key in tolerances]
            override = tolerances[keys[0]] if keys else Tolerance()
            used.update(keys)
            boxes = (
                box_rule(torch.as_tensor(ref), iou_threshold, image_size)
                if looks_like_boxes(ref, last, siblings)
                else None
            )
            ceiling, of = override.ceiling, None
            if ceiling is None and is_half(computed_in) and boxes is None:
                ceiling, of = _half_ceiling(ref, computed_in)
            result.outputs[path] = compare_tensors(
                ref,
                cand,
                rtol=override.rtol if override.rtol is not None else rtol,
                atol=override.atol if override.atol is not None else atol,
                ceiling=ceiling,
                ceiling_source=of,
                source=override.source or source,
                boxes=boxes,
            )
        elif ref is None or isinstance(ref, str):
            if ref != cand:
                result.reasons.append(f"{path}: {cand!r} differs from the reference's {ref!r}")
        else:
            raise TypeError(
                f"reference {path}: cannot compare outputs of type {type(ref).__name__}; "
                "expected tensors, numbers, strings, None, or tuples, lists and dicts of them"
            )

    visit(name, None, reference, candidate, list(noisy))
    result.degenerate = degenerate_reasons(reference, inputs, name)
    unused = set(tolerances) - used
    if unused and not result.reasons:  # a structure that differs leaves some unvisited
        raise ValueError(
            f"tolerances: no output is named {sorted(map(str, unused))}; "
            f"outputs are {list(result.outputs)}"
        )
    return result


def _half_ceiling(reference, computed_in: torch.dtype) -> tuple[float | None, str | None]:
    """``spread_ceiling`` of a floating-point output computed in 16 bits, and why;
    None for any other output."""
    tensor = torch.as_tensor(reference)
    if not tensor.is_floating_point():
        return None, None
    ceiling, of = spread_ceiling(tensor)
    return ceiling, f"{of} in {dtype_name(computed_in)}"


def tensor_paths(value, path: str = "out"):
    """(path, tensor) of every tensor in ``value``, named as ``compare_outputs`` names
    them; detection lists are left out (they are compared as detections)."""
    if is_detection_list(value):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from tensor_paths(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensor_paths(item, f"{path}[{index}]")
    elif isinstance(value, torch.Tensor):
        yield path, value
