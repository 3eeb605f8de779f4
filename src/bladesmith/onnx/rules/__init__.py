"""Rules for `bladesmith check`: one module per family, each exporting RULES, a tuple of
functions `(GraphView, Target) -> list[Finding]`. A new rule is a function added to its
module's RULES (or a new module added below); checker.py runs them all in this order.
"""

from bladesmith.onnx.rules import (
    dtypes,
    operators,
    opset,
    restrictions,
    shape_tensors,
    shapes,
)

RULES = (
    *opset.RULES,
    *operators.RULES,
    *restrictions.RULES,
    *shape_tensors.RULES,
    *shapes.RULES,
    *dtypes.RULES,
)
