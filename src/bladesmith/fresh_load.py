"""Load a saved artifact and run it in a new Python process, as a deployment would.

A loader that crashes (a native segmentation fault inside torch's AOTInductor package
loader, say) would take the saving process down with it; in a child it becomes an exit
status, and the artifact is reported as not loading rather than the save crashing. A
new process also proves what an in-process reload cannot: that nothing the saving
process had loaded (operator libraries, compiled kernels) is needed. ``reload_problem``
compares what it gives with the optimized module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Outputs go back as plain containers (typed_outputs.plain), which ``weights_only`` reads:
# the saving process compares values; the types are the loader's to find (a new process
# may not have imported the user's module that defines them).
_CHILD = """
import sys, torch, bladesmith
from bladesmith.typed_outputs import plain
module = bladesmith.load(sys.argv[1])
calls = torch.load(sys.argv[2], weights_only=True)
torch.save([plain(module(*args)) for args in calls], sys.argv[3])
"""
TIMEOUT_S = 600


def run_saved(path: Path, args: tuple) -> tuple[object, str | None]:
    """(the outputs of ``bladesmith.load(path)(*args)`` computed in a new process, None),
    or (None, why it failed there: the child's last error line or the signal that
    ended it)."""
    outputs, problem = run_saved_each(path, [args])
    return (None, problem) if problem is not None else (outputs[0], None)


def run_saved_each(path: Path, calls: list[tuple]) -> tuple[list | None, str | None]:
    """``run_saved`` of each of ``calls`` (argument tuples), in one new process: (their
    outputs, None) or (None, why it failed)."""
    return in_new_process(_CHILD, path, [tuple(args) for args in calls])


def in_new_process(code: str, path: Path, payload) -> tuple[object, str | None]:
    """(what ``code`` saved, None) or (None, why it failed), ``code`` run in a new Python
    process as ``python -c code PATH PAYLOAD RESULT``: PAYLOAD a file holding
    ``payload`` (torch.save), RESULT the file its result is to be saved in (weights only)."""
    with tempfile.TemporaryDirectory(prefix="bladesmith-reload-") as folder:
        inputs, outputs = Path(folder) / "args.pt", Path(folder) / "outputs.pt"
        torch.save(payload, inputs)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            result = subprocess.run(
                [sys.executable, "-c", code, str(path), str(inputs), str(outputs)],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return None, f"loading and running it in a new process took over {TIMEOUT_S} s"
        if result.returncode != 0:
            return None, _why(result)
        return torch.load(outputs, weights_only=True), None


def reload_problem(optimized, path: Path) -> str | None:
    """Why the artifact at ``path`` is not ``optimized`` (it does not load and run in a
    new process, or its outputs on a test input of each signature differ past the spec's
    tolerance there), or None when it is."""
    from bladesmith.runtimes.built_for import describe_tensors, signature
    from bladesmith.verify import compare_outputs, detection_score_tolerance

    calls = optimized.verified_args
    outputs, problem = run_saved_each(path, calls)
    if problem is not None:
        return f"it does not load back: {problem}"
    spec = optimized.spec
    rtol, atol = spec.tolerance.get("rtol"), spec.tolerance.get("atol")
    # Detection scores as the gate judged them: what the dtype computed in may move them.
    judged_at = rtol + atol if rtol is not None and atol is not None else 0.0
    score_atol = detection_score_tolerance(getattr(torch, spec.dtype), judged_at)
    for args, got in zip(calls, outputs, strict=True):
        comparison = compare_outputs(
            optimized(*args), got, rtol=rtol, atol=atol, score_atol=score_atol
        )
        if not comparison.passed:
            at = f" at {describe_tensors(signature(args))}" if len(calls) > 1 else ""
            return f"loaded back, its outputs{at} differ: {comparison.summary()}"
    return None


def _why(result: subprocess.CompletedProcess) -> str:
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        return f"a new process loading it was killed by {name} (torch's loader crashed)"
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {result.returncode}"
    return f"a new process could not load and run it ({last})"
