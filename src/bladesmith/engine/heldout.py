"""The held-out check: a result against the model as given on inputs no pass saw.

Passes are built and verified on the test data; a result may be right there alone (a
trace that held its example as a constant answers it exactly). Every candidate that
would be kept, the final result and every saved format are also run on held-out
inputs derived from the test data (``verify.heldout``) and judged against the model as
given there, at the tolerances measured on the test data, or, where its precision is
judged by the task's metric (int8, float8), by that metric (``verify.task_metric``) on
a larger set of at least ``METRIC_ITEMS`` items, since a bar such as 0.99 means nothing
over a few. A result that fails there and answers the held-out inputs exactly as it
answered the test data, where the model as given answers otherwise, does not depend on
its inputs: it is refused with that reason, even where ``disable_fp16_accuracy_check``
waives its tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from bladesmith.config import Config
from bladesmith.engine.reference import Reference
from bladesmith.errors import describe
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context
from bladesmith.verify import degenerate_reasons, task_metric
from bladesmith.verify.heldout import VARIANTS, HeldOut, held_out_inputs, items

# A metric's verdict counts over at least this many items (images, rows) where the test
# data's signatures allow: one disagreement in n moves agreement by 1/n.
METRIC_ITEMS = 100


@dataclass(frozen=True)
class Verdict:
    """A held-out check's outcome, in one line (``summary``, as a Comparison gives)."""

    passed: bool
    line: str
    metric: dict | None = None  # the task metric's figures, where it judged

    def summary(self) -> str:
        return self.line


class HeldOutCheck:
    """The model as given on held-out inputs, run on first use (``outputs_of(candidate,
    args)`` runs a candidate on a list of argument tuples)."""

    def __init__(
        self,
        reference: Reference,
        given: Candidate,
        context: Context,
        outputs_of: Callable,
        inputs: HeldOut | None = None,
    ):
        self._reference, self._given, self._context = reference, given, context
        self._outputs_of = outputs_of
        self._inputs = inputs  # the user's (Config.held_out_data), for both sets
        # Per set (False: the tolerance checks'; True: the metric's): the model's outputs
        # there, the test entry each input came from, and what the set is (or why none).
        self._sets: dict[bool, tuple[Reference | None, list[int], str]] = {}

    @property
    def how(self) -> str:
        return self.described()

    def described(self, by_metric: bool = False) -> str:
        """What the held-out inputs (``by_metric``: the metric's) are, once made; why
        there are none."""
        key = self._key(by_metric)
        return self._sets[key][2] if key in self._sets else ""

    def _key(self, by_metric: bool) -> bool:
        """Which set judges: the user's held-out inputs are one set for both."""
        return by_metric and self._inputs is None

    def args(self, by_metric: bool = False) -> list[tuple]:
        """The held-out inputs (``by_metric``: those a metric verdict counts over)."""
        held = self._prepared(by_metric)
        return list(held.inputs) if held is not None else []

    def _prepared(self, by_metric: bool = False) -> Reference | None:
        key = self._key(by_metric)
        if key not in self._sets:
            self._sets[key] = self._made(key)
        return self._sets[key][0]

    def _made(self, by_metric: bool) -> tuple[Reference | None, list[int], str]:
        held = self._inputs
        if held is None:
            test_args = self._context.test_args
            # A metric's bar tells 0.99 from 1.0 only over 100 items: that many at least.
            variants = -(-METRIC_ITEMS // items(test_args)) if by_metric else 0
            held = held_out_inputs(test_args, max(variants, len(VARIANTS)))
        whose = "the metric's " if by_metric else ""
        step = f"running the model as given on {whose}held-out inputs"
        try:
            with self._context.step(step):
                outputs = self._outputs_of(self._given, held.args)
        except Exception as error:
            self._context.notes.append(
                f"Held-out inputs ({held.how}): the model as given failed on them "
                f"({describe(error)}); results are verified on the test data only."
            )
            return None, [], f"none: the model as given failed on them ({describe(error)})"
        kept = [i for i, out in enumerate(outputs) if not degenerate_reasons(out, held.args[i])]
        if not kept:
            return None, [], "none: the model as given answers nothing on them (no finite output)"
        sources = [held.sources[i] for i in kept]
        reference = self._reference.on(
            [held.args[i] for i in kept], [outputs[i] for i in kept], sources
        )
        whom = "every result the task's metric judges" if by_metric else "every result kept"
        self._context.notes.append(
            f"Held-out inputs{' for the metric' if by_metric else ''}: {len(kept)} "
            f"{held.how.split(' ', 1)[1]}: {whom} is checked on them against the model "
            "as given."
        )
        which = "given by Config.held_out_data" if self._inputs else "held-out input(s)"
        return reference, sources, f"{len(kept)} {which}"

    def check(
        self,
        candidate: Candidate,
        test_outputs: list,
        config: Config,
        *,
        who: str,
        waived: bool = False,
    ) -> Verdict | None:
        """``candidate`` (``who``: the pass, or what it is, for the reason) on the held-out
        inputs, given its outputs on the test data; None when there are none to check on.
        ``waived``: its tolerance is not held against it (the dependence on the inputs
        still is)."""
        by_metric = candidate.computes_in.by_metric
        held = self._prepared(by_metric)
        if held is None:
            return None
        try:
            outputs = self._outputs_of(candidate, held.inputs)
        except Exception as error:
            return Verdict(False, f"{who} failed on held-out inputs ({describe(error)})")
        return self.judge(
            test_outputs,
            outputs,
            candidate.dtype,
            config,
            who=who,
            waived=waived,
            by_metric=by_metric,
        )

    def judge(
        self,
        test_outputs: list,
        outputs: list,
        dtype: torch.dtype,
        config: Config,
        *,
        who: str,
        waived: bool = False,
        by_metric: bool = False,
    ) -> Verdict:
        """Outputs on the held-out inputs (``outputs``; ``args(by_metric)``) judged
        against the model's there (``by_metric``: by the task's metric, which no waiver
        excuses); when they fail, whether they answer as on the test data
        (``test_outputs``) where the model does not: then they ignore their inputs, which
        no waiver excuses either."""
        held = self._prepared(by_metric)
        if by_metric:
            return self._by_metric(held, test_outputs, outputs, config, who)
        try:
            comparison = held.compare(outputs, dtype, config)
        except Exception as error:  # a comparison that cannot be made verifies nothing
            return Verdict(
                False,
                f"{who}: its outputs on held-out inputs ({self.how}) could not be compared "
                f"with the model's ({describe(error)})",
            )
        if comparison.passed:
            return Verdict(True, f"held-out inputs within tolerance ({self.how})")
        constant = self._constant(held, test_outputs, outputs, who)
        if constant is not None:
            return constant
        if waived:
            return Verdict(True, f"held-out inputs past tolerance, check disabled ({self.how})")
        return Verdict(
            False,
            f"{who}: on held-out inputs ({self.how}) outputs moved past tolerance: "
            f"{comparison.summary()}",
        )

    def _by_metric(self, held: Reference, test_outputs, outputs, config, who) -> Verdict:
        """The task's metric on the held-out inputs against the model as given."""
        measured = task_metric.judge(held.outputs, outputs, held.inputs, config)
        if isinstance(measured, str):
            return Verdict(False, f"{who}: not judged by the task's metric: {measured}")
        line = f"{measured.line} on held-out inputs ({self.described(True)})"
        if measured.passed:
            return Verdict(True, line, measured.to_dict())
        constant = self._constant(held, test_outputs, outputs, who, by_metric=True)
        if constant is not None:
            line += "; " + constant.line.removeprefix(f"{who}: ")
        return Verdict(False, f"{who}: {line}", measured.to_dict())

    def _constant(
        self, held: Reference, test_outputs, outputs, who, by_metric: bool = False
    ) -> Verdict | None:
        """A failing verdict when the result answers a held-out input exactly as it
        answered the test input it came from, where the model as given answers otherwise
        (it held the test input as a constant); None otherwise."""
        reference = self._reference
        _, sources, how = self._sets[self._key(by_metric)]
        for index, source in enumerate(sources):
            model_moved = not _identical(reference.outputs[source], held.outputs[index])
            if model_moved and _identical(test_outputs[source], outputs[index]):
                return Verdict(
                    False,
                    f"{who}: its outputs do not depend on its inputs: on held-out inputs "
                    f"({how}) it answered exactly what it answered on the test data, "
                    "where the model as given answers otherwise (the test input was held "
                    "as a constant)",
                )
        return None


def _identical(one, other) -> bool:
    """The same structure holding the same values, exactly."""
    leaves, spec = pytree.tree_flatten(one)
    other_leaves, other_spec = pytree.tree_flatten(other)
    if spec != other_spec:
        return False
    for x, y in zip(leaves, other_leaves, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y.to(x.device)):
                return False
        elif x != y:
            return False
    return True
