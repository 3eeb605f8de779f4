"""The task's metric: how a result whose precision is judged by it (int8: its outputs
move by far more than rounding, ``verify.precisions``) is judged on the held-out inputs
against the model as given.

- A classifier (one floating-point output [batch, classes]): top-1 agreement, the share
  of items whose highest class is the model's, at least ``1 - max_drop`` (0.99 by
  default); top-5 agreement (the model's class among the result's five highest) is
  reported beside it.
- A detector (lists of {"boxes", "scores", "labels"}): detections matched to the
  model's by class at IoU 0.5, one to one; F1 at least ``1 - max_drop`` (0.97 by
  default), and the score-ranked mAP against the model's detections reported beside it.
- ``Config(metric=f)``: ``f(outputs, inputs)`` (a list of outputs, one per call, and the
  argument tuples they answer) -> a number, higher is better; the result's may fall
  ``max_drop`` (0.01 by default) below the model as given's.

What a count of items can claim: one item in n that disagrees moves agreement by 1/n,
so 0.99 is told apart from 1.0 only from 100 items on; the engine judges on at least
that many held-out items (``engine.heldout.METRIC_ITEMS``), and the verdict says how
many it counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils import _pytree as pytree

from bladesmith.config import Config
from bladesmith.errors import describe
from bladesmith.verify.detections import _as_arrays, is_detection_list
from bladesmith.verify.matching import box_iou, matches

TOP1_MAX_DROP = 0.01
DETECTION_MAX_DROP = 0.03
USER_MAX_DROP = 0.01
DETECTION_IOU = 0.5


@dataclass(frozen=True)
class MetricVerdict:
    """A metric's value for the result, the model as given's, the drop and the bar."""

    metric: str
    value: float
    given: float
    bar: float  # the least value that passes
    count: int  # items the value counts over (predictions, detections, calls)
    extra: str = ""  # what is reported beside it (top-5, mAP)

    @property
    def drop(self) -> float:
        return self.given - self.value

    @property
    def passed(self) -> bool:
        return self.value >= self.bar

    @property
    def line(self) -> str:
        verdict = "holds" if self.passed else "is below"
        return (
            f"{self.metric} {self.value:.4g} (model as given {self.given:.4g}, drop "
            f"{self.drop:.4g}) {verdict} the bar {self.bar:.4g} over {self.count} "
            f"{'items' if self.count != 1 else 'item'}{self.extra}"
        )

    def to_dict(self) -> dict:
        return {
            "metric": self.metric,
            "value": self.value,
            "given": self.given,
            "drop": self.drop,
            "bar": self.bar,
            "count": self.count,
        }


def judge(reference: Sequence, outputs: Sequence, inputs: Sequence[tuple], config: Config):
    """``outputs`` (one per call of ``inputs``) against the model's ``reference`` by the
    task's metric: a ``MetricVerdict``, or a one-line reason why none applies."""
    if config.metric is not None:
        try:
            given = float(config.metric(list(reference), list(inputs)))
            value = float(config.metric(list(outputs), list(inputs)))
        except Exception as error:
            return f"Config.metric failed ({describe(error)})"
        drop = config.max_drop if config.max_drop is not None else USER_MAX_DROP
        name = getattr(config.metric, "__name__", "Config.metric")
        return MetricVerdict(f"Config.metric {name}", value, given, given - drop, len(outputs))
    detections = [_detections(each) for each in reference]
    if all(d is not None for d in detections) and detections:
        found = [_detections(each) for each in outputs]
        if any(f is None or len(f) != len(d) for f, d in zip(found, detections, strict=True)):
            return "the result's outputs hold no detections where the model's do"
        return _detection_agreement(
            [x for each in detections for x in each], [x for each in found for x in each], config
        )
    logits = [_class_scores(each) for each in reference]
    if all(x is not None for x in logits) and logits:
        got = [_class_scores(each) for each in outputs]
        if any(g is None or g.shape != x.shape for g, x in zip(got, logits, strict=True)):
            return "the result's class scores differ in shape from the model's"
        return _top1_agreement(torch.cat(logits), torch.cat(got), config)
    return (
        "no task metric fits these outputs (neither class scores [batch, classes] nor "
        "detections): Config(metric=...) sets one"
    )


def _class_scores(output) -> torch.Tensor | None:
    """The output's class scores [items, classes]: its one floating-point tensor, 2-D
    with at least two classes; None otherwise."""
    leaves = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
    floats = [x for x in leaves if x.is_floating_point()]
    if len(floats) != 1 or floats[0].dim() != 2 or floats[0].shape[-1] < 2:
        return None
    return floats[0].detach().float().cpu()


def _top1_agreement(
    reference: torch.Tensor, got: torch.Tensor, config: Config
) -> MetricVerdict | str:
    top1 = reference.argmax(-1)
    if len(top1) > 1 and top1.unique().numel() == 1 and not config.allow_degenerate:
        # Random weights often do this: any result that answers one class agrees.
        return (
            f"the model as given gives all {len(top1)} held-out items one class, so "
            "agreement cannot tell a right result from a wrong one; give test data whose "
            "classes differ, Config(metric=...), or Config(allow_degenerate=True)"
        )
    agree = float((got.argmax(-1) == top1).float().mean())
    k = min(5, reference.shape[-1])
    top5 = float((got.topk(k, -1).indices == top1[:, None]).any(-1).float().mean())
    drop = config.max_drop if config.max_drop is not None else TOP1_MAX_DROP
    return MetricVerdict(
        "top-1 agreement", agree, 1.0, 1.0 - drop, len(top1), f"; top-{k} agreement {top5:.4g}"
    )


def _detections(output) -> list | None:
    """The detection lists in ``output``, one (boxes, scores, labels) per image, in
    order; None when it holds none."""
    if is_detection_list(output):
        return [_as_arrays(each) for each in output]
    if isinstance(output, dict):
        found = [_detections(each) for each in output.values()]
    elif isinstance(output, (list, tuple)):
        found = [_detections(each) for each in output]
    else:
        return None
    found = [each for each in found if each is not None]
    return [x for each in found for x in each] if found else None


def _detection_agreement(reference: list, got: list, config: Config) -> MetricVerdict:
    """F1 of ``got``'s detections matched to ``reference``'s (per image) by class at IoU
    0.5, with the score-ranked mAP of ``got`` taking ``reference`` as the truth."""
    matched = total_ref = total_got = 0
    for (boxes, _, labels), (other, _, other_labels) in zip(reference, got, strict=True):
        hit, _ = matches((boxes, labels), (other, other_labels), DETECTION_IOU)
        matched += int(hit.sum())
        total_ref, total_got = total_ref + len(boxes), total_got + len(other)
    if total_ref == total_got == 0:
        f1 = 1.0
    else:
        f1 = 2 * matched / (total_ref + total_got)
    drop = config.max_drop if config.max_drop is not None else DETECTION_MAX_DROP
    extra = f"; mAP@0.5 {mean_average_precision(reference, got):.4g}"
    return MetricVerdict(
        "detection F1 at IoU 0.5", f1, 1.0, 1.0 - drop, max(total_ref, total_got), extra
    )


def mean_average_precision(reference: list, got: list) -> float:
    """The mean over the reference's classes of the average precision of ``got``'s
    detections, ranked by score, each a hit when it overlaps an unmatched reference
    detection of its image and class at IoU 0.5 (every point of the curve)."""
    classes = sorted({int(c) for _, _, labels in reference for c in labels})
    if not classes:
        return 1.0 if not any(len(b) for b, _, _ in got) else 0.0
    precisions = []
    for cls in classes:
        ranked = []  # (score, image, box)
        truth = {}
        for image, ((boxes, _, labels), (other, scores, other_labels)) in enumerate(
            zip(reference, got, strict=True)
        ):
            truth[image] = (boxes[labels == cls], np.zeros(int((labels == cls).sum()), bool))
            ranked += [
                (s, image, b)
                for s, b in zip(scores[other_labels == cls], other[other_labels == cls])
            ]
        ranked.sort(key=lambda each: -each[0])
        hits = []
        for _, image, box in ranked:
            boxes, taken = truth[image]
            iou = box_iou(box[None], boxes)[0] if len(boxes) else np.zeros(0)
            iou = np.where(taken, -1.0, iou)
            best = int(iou.argmax()) if len(iou) else -1
            hit = best >= 0 and iou[best] >= DETECTION_IOU
            if hit:
                taken[best] = True
            hits.append(hit)
        count = sum(len(t[0]) for t in truth.values())
        tp = np.cumsum(hits) if hits else np.zeros(0)
        recall = tp / count
        precision = tp / np.arange(1, len(hits) + 1) if hits else np.zeros(0)
        # Every point: precision made monotone from the right, summed over recall steps.
        envelope = np.maximum.accumulate(precision[::-1])[::-1] if hits else precision
        steps = np.diff(np.concatenate([[0.0], recall]))
        precisions.append(float((envelope * steps).sum()))
    return float(np.mean(precisions))
