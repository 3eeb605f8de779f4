"""The rewrites `fix` makes, one module each, every one declaring (``Fix.resolves``) the
ids of the `check` rules whose findings it resolves. A new fix is one module defining
``FIX`` plus one line in ``STEPS``.

``STEPS`` is the order fixer runs its checked steps in: fold what is constant, do what
is left of float shape arithmetic in integers, drop the constants both leave unread, then
convert the opset. Static input shapes and declared output shapes come before them, as
the model every step starts from. ``BY_RULE`` maps a rule id to its fixes;
``NOT_AUTO_FIXABLE`` says, for every other rule, why no graph rewrite answers it.
"""

from __future__ import annotations

from bladesmith.onnx.fixes import (
    constant_fold,
    integer_shape_arithmetic,
    opset_conversion,
    output_shapes,
    static_input_shapes,
    unused_initializers,
)
from bladesmith.onnx.fixes.base import Fix
from bladesmith.onnx.rules.dtypes import INT64_RULE
from bladesmith.onnx.rules.operators import CUSTOM_RULE, UNSUPPORTED_RULE
from bladesmith.onnx.rules.restrictions import RULE as USAGE_RULE
from bladesmith.onnx.rules.shape_tensors import PLUGIN_RULE
from bladesmith.onnx.rules.shapes import ZERO_RULE
from bladesmith.onnx.rules.validity import RULE as INVALID_RULE

STEPS = (
    constant_fold.FIX,
    integer_shape_arithmetic.FIX,
    unused_initializers.FIX,
    opset_conversion.FIX,
)
FIXES = (static_input_shapes.FIX, output_shapes.FIX, *STEPS)

NOT_AUTO_FIXABLE = {
    INVALID_RULE: "fix rewrites valid graphs only: correct the model or export it again",
    UNSUPPORTED_RULE: "the target has no kernel for the operator, and another "
    "implementation of it is the exporter's choice (custom_ops) or a plugin, not a rewrite",
    CUSTOM_RULE: "a custom operator's semantics are its library's: export with "
    "custom_ops='standard' or register the operator with register_op",
    USAGE_RULE: "each restriction (an attribute value, an element type, a rank) would need "
    "its own equivalent form in what the target accepts, and none is written",
    PLUGIN_RULE: "a shape computed from a plugin's values changes only when the operator "
    "gives fixed-size (padded) outputs, which is a change of the operator",
    ZERO_RULE: "an empty or data-dependent size is the model's design; fixed-size padded "
    "outputs plus a count are a change of the model",
    INT64_RULE: "narrowing INT64 inputs and outputs would change the model's interface, "
    "which fix keeps, and INT64 constants outside INT32 have no INT32 equal",
}


# rule id -> the fixes that resolve its findings, in the order fix runs them
BY_RULE: dict[str, tuple[Fix, ...]] = {
    rule: tuple(other for other in FIXES if rule in other.resolves)
    for fix in FIXES
    for rule in fix.resolves
}


__all__ = ["BY_RULE", "FIXES", "NOT_AUTO_FIXABLE", "STEPS", "Fix"]
