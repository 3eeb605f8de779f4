"""head_packing: RetinaNet's head runs once over all pyramid levels packed into one
canvas instead of once per level (``bladesmith.models.packed_head``): ten convolutions
instead of fifty, each large enough to keep a GPU busy at batch 1."""

from __future__ import annotations

import copy

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class HeadPacking(Pass):
    """RetinaNet head over all levels at once, packed into one canvas."""

    name = "head_packing"
    # A GPU gains occupancy and launches; a CPU, busy either way, only pays for the gaps.
    devices = ("cuda",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        from bladesmith.models.packed_head import PackedRetinaNetHead, packing_problem
        from bladesmith.models.retinanet import RetinaNetPipeline

        module = candidate.module
        if not isinstance(module, RetinaNetPipeline):
            return "it packs the head of the fixed-shape RetinaNet pipeline (retinanet_adapter)"
        if isinstance(module.head, PackedRetinaNetHead):
            return "the head is already packed"
        problem = packing_problem(module.head)
        return None if problem is None else f"the head cannot be packed: {problem}"

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        module.pack_head()
        return candidate.with_module(module, self.name)
