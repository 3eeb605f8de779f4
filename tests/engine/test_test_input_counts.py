"""Any number of test inputs, of one shape or several, is verified: the held-out inputs
(two per input signature) are judged at the tolerances measured on the test input each
was derived from, whatever the two counts are. Before, the held-out check used the
tolerances keyed by the test calls' positions, and four test inputs of one shape (two
held-out inputs) ended in "ValueError: tolerances: no output is named ['out[2]',
'out[3]']"."""

from __future__ import annotations

import pytest
import torch
from torchvision.models import resnet18

import bladesmith
from bladesmith.config import Config
from bladesmith.engine.reference import Reference
from bladesmith.passes import Candidate
from bladesmith.passes.norm_folding import NormFolding
from engine_testing import Memoized, context_for, conv_net, randomize_norms

# Accuracy decides here: memoized keeps the passes before it whatever the timing noise.
QUICK = Config(warmup=0, iters=2, min_speedup=1e-6, progress=False)


def inputs_of(count: int, shapes: list[int]) -> list[tuple]:
    """``count`` test inputs, their sizes taken from ``shapes`` in turn."""
    torch.manual_seed(count)
    return [
        (torch.rand(1, 3, shapes[i % len(shapes)], shapes[i % len(shapes)]),) for i in range(count)
    ]


def assert_verified(spec, report, passes: tuple[str, ...], held_out: int) -> None:
    assert spec.passes == passes, [r.reason for r in report.optimizations]
    assert report.accuracy["passed"], report.accuracy["summary"]
    line = report.accuracy["held_out"]
    assert line == f"held-out inputs within tolerance ({held_out} held-out input(s))", line
    for record in report.optimizations:
        assert "held-out inputs within tolerance" in record.reason, record.reason


@pytest.mark.parametrize("count", [1, 2, 3, 8])
@pytest.mark.parametrize("shapes", [[32], [32, 48]], ids=["one-shape", "two-shapes"])
def test_any_number_of_test_inputs_is_verified(count, shapes):
    model = randomize_norms(conv_net())
    data = inputs_of(count, shapes)
    optimized, spec, report = bladesmith.optimize(
        model, "o1", "cpu", test_data=data, config=QUICK, passes=[NormFolding(), Memoized()]
    )
    signatures = min(count, len(shapes))
    assert_verified(spec, report, ("norm_folding", "memoized"), held_out=2 * signatures)
    for args in inputs_of(count + 1, shapes)[-2:]:  # inputs no pass saw
        torch.testing.assert_close(optimized(*args), model(*args), rtol=1e-4, atol=1e-5)


def test_resnet18_on_four_test_inputs_of_one_shape():
    model = resnet18(weights=None).eval()
    data = [(torch.rand(1, 3, 64, 64),) for _ in range(4)]
    _, spec, report = bladesmith.optimize(
        model, "o1", "cpu", test_data=data, config=QUICK, passes=[NormFolding(), Memoized()]
    )
    assert_verified(spec, report, ("norm_folding", "memoized"), held_out=2)


def test_each_held_out_input_is_judged_at_its_own_test_inputs_tolerance():
    # Two test inputs whose outputs differ by a factor of 1000 in magnitude (a linear
    # model), so their measured tolerances do too: a held-out input derived from the
    # second is judged at the second's, never at the first's nor at the largest of all.
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 3, bias=False).eval()
    small, large = torch.rand(1, 3, 16, 16) * 1e-3, torch.rand(1, 3, 24, 24)
    context = context_for((small,))
    context.test_args = [(small,), (large,)]
    given = Candidate(model, context.device)
    with torch.no_grad():
        reference = Reference([model(small), model(large)], given, context)
        held_args = [(large * 0.9,), (small * 0.9,), (large.flip(-1),)]
        held = reference.on(held_args, [model(*args) for args in held_args], sources=[1, 0, 1])
    measured = reference.measured.tolerances
    assert measured["out[1]"].atol > 100 * measured["out[0]"].atol
    judged = held.compare(held.outputs, torch.float32, context.config).outputs
    assert judged["out[0]"].atol == measured["out[1]"].atol
    assert judged["out[1]"].atol == measured["out[0]"].atol
    assert judged["out[2]"].atol == measured["out[1]"].atol


def test_a_held_out_comparison_that_cannot_be_made_rejects_the_pass_in_one_line(monkeypatch):
    # The tolerances keyed as before (by the test calls' positions) make the held-out
    # comparison raise: the pass is rejected with the error in its reason, and optimize
    # returns the model as given rather than a traceback.
    from bladesmith.engine import reference

    monkeypatch.setattr(reference, "_for_calls", lambda measured, sources, outputs: measured)
    model = randomize_norms(conv_net())
    data = inputs_of(4, [32])
    optimized, spec, report = bladesmith.optimize(
        model, "o1", "cpu", test_data=data, config=QUICK, passes=[NormFolding()]
    )
    (record,) = report.optimizations
    assert record.status == "rejected"
    assert record.reason.startswith(
        "norm_folding: its outputs on held-out inputs (2 held-out input(s)) could not be "
        "compared with the model's (ValueError: tolerances: no output is named"
    ), record.reason
    assert "\n" not in record.reason and spec.passes == ()
