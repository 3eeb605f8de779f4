"""head_packing: a detector's head runs once over all pyramid levels packed into one
canvas instead of once per level (RetinaNet: ``families.retinanet_head``): ten
convolutions instead of fifty, each large enough to keep a GPU busy at batch 1. The
pipeline says whether it can (``packing_problem``) and does it (``pack_head``)."""

from __future__ import annotations

import copy

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class HeadPacking(Pass):
    """Detection head over all levels at once, packed into one canvas (RetinaNet)."""

    name = "head_packing"
    # A GPU gains occupancy and launches; a CPU, busy either way, only pays for the gaps.
    devices = ("cuda",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        problem = getattr(candidate.module, "packing_problem", None)
        if problem is None:
            return "it packs the head of a fixed-shape pipeline that has one (fixed_shape)"
        return problem()

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        module.pack_head()
        return candidate.with_module(module, self.name)
