"""The fixes are keyed by the `check` rules they resolve: every declared rule id is one
the checker reports, every rule the checker reports has a fix or a reason why none can
be, every fix module is registered, and each declaration is seen to hold on a model."""

from __future__ import annotations

import importlib
import pkgutil

import check_models as models
import onnx
import pytest

from bladesmith.onnx import fixes
from bladesmith.onnx.checker import check
from bladesmith.onnx.fixer import fix
from bladesmith.onnx.rules import RULES
from bladesmith.onnx.rules.validity import invalid_graph


def checker_rule_ids() -> set[str]:
    """The ids of every rule the checker runs: the `RULE` and `*_RULE` string constants of
    the modules that define its rule functions (how each rules module names its ids)."""
    modules = {rule.__module__ for rule in RULES} | {invalid_graph.__module__}
    return {
        value
        for module in map(importlib.import_module, modules)
        for name, value in vars(module).items()
        if (name == "RULE" or name.endswith("_RULE")) and isinstance(value, str)
    }


def test_the_rule_ids_are_read_from_every_rules_module():
    ids = checker_rule_ids()
    assert {"float-shape-arithmetic", "invalid-graph", "opset-too-old", "int64-narrowed"} <= ids
    for module in {rule.__module__ for rule in RULES}:  # each module names at least one
        constants = vars(importlib.import_module(module)).items()
        assert any(n == "RULE" or n.endswith("_RULE") for n, _ in constants), module


def test_every_fix_declares_rule_ids_the_checker_has():
    for fix_ in fixes.FIXES:
        unknown = set(fix_.resolves) - checker_rule_ids()
        assert not unknown, f"{fix_.kind} declares rules no check rule has: {unknown}"
    assert set(fixes.BY_RULE) <= checker_rule_ids()


def test_every_rule_has_a_fix_or_a_reason_it_has_none():
    ids = checker_rule_ids()
    assert set(fixes.NOT_AUTO_FIXABLE) <= ids
    assert not set(fixes.BY_RULE) & set(fixes.NOT_AUTO_FIXABLE)
    assert ids == set(fixes.BY_RULE) | set(fixes.NOT_AUTO_FIXABLE), (
        "a check rule with neither a fix nor a reason in fixes.NOT_AUTO_FIXABLE: "
        f"{ids - set(fixes.BY_RULE) - set(fixes.NOT_AUTO_FIXABLE)}"
    )
    assert all(reason.strip() for reason in fixes.NOT_AUTO_FIXABLE.values())


def test_every_fix_module_is_registered_once_with_its_own_kind():
    helpers = {"base", "equivalence", "integer_chains", "names", "separate_chains"}
    modules = {info.name for info in pkgutil.iter_modules(fixes.__path__)} - helpers
    declared = {importlib.import_module(f"{fixes.__name__}.{name}").FIX for name in modules}
    assert declared == set(fixes.FIXES) and len(fixes.FIXES) == len(modules)
    assert len({fix_.kind for fix_ in fixes.FIXES}) == len(fixes.FIXES)
    assert set(fixes.STEPS) <= set(fixes.FIXES)


def resize(**kwargs):
    return models.float_resize_sizes(**kwargs)


# (fix kind, rule) -> a model with a finding of that rule, its target and input shapes
RESOLVED = {
    ("static-input-shapes", "dynamic-dim"): (resize, "tensorrt", {"x": [1, 3, 6, 10]}),
    ("constant-fold", "float-shape-arithmetic"): (lambda: resize(static=True), "tensorrt", None),
    ("integer-shape-arithmetic", "float-shape-arithmetic"): (resize, "tensorrt", None),
    ("opset-conversion", "opset-too-new"): (lambda: models.reduce_mean(21), "directml", None),
    ("opset-conversion", "opset-too-old"): (lambda: models.relu(opset=8), "tensorrt", None),
}


def test_each_declared_rule_has_a_model_its_fix_resolves():
    declared = {(fix_.kind, rule) for fix_ in fixes.FIXES for rule in fix_.resolves}
    assert declared == set(RESOLVED)


@pytest.mark.parametrize(("kind", "rule"), sorted(RESOLVED))
def test_a_fix_resolves_the_findings_of_the_rules_it_declares(kind, rule, tmp_path):
    make, target, shapes = RESOLVED[(kind, rule)]
    source = tmp_path / "in.onnx"
    onnx.save(make(), source)
    assert any(finding.rule == rule for finding in check(str(source), target))
    result = fix(source, tmp_path / "out.onnx", target, input_shapes=shapes)
    kinds = [r.kind for r in result.applied if not r.detail.startswith("skipped: ")]
    assert kind in kinds
    assert not any(finding.rule == rule for finding in result.remaining)
