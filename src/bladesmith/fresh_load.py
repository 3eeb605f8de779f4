"""Load a saved artifact and run it in a new Python process, as a deployment would.

A loader that crashes (a native segmentation fault inside torch's AOTInductor package
loader, say) would take the saving process down with it; in a child it becomes an exit
status, and the artifact is reported as not loading rather than the save crashing. A
new process also proves what an in-process reload cannot: that nothing the saving
process had loaded (operator libraries, compiled kernels) is needed. ``reload_problem``
compares what it gives with the optimized module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch

# Outputs go back as plain containers (typed_outputs.plain), which ``weights_only`` reads:
# the saving process compares values; the types are the loader's to find (a new process
# may not have imported the user's module that defines them).
_CHILD = """
import sys, torch, bladesmith
from bladesmith.trust import QUIET
from bladesmith.typed_outputs import plain
module = bladesmith.load(sys.argv[1], trust=QUIET)
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
        try:
            result = subprocess.run(
                [sys.executable, "-c", code, str(path), str(inputs), str(outputs)],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                env=_child_env(),
            )
        except subprocess.TimeoutExpired:
            return None, _too_long()
        if result.returncode != 0:
            return None, _why(result.returncode, result.stderr)
        return torch.load(outputs, weights_only=True), None


class NewProcessFailed(Exception):
    """A conversation's process died or went silent; the message says why, in one line."""


# Run before a conversation's code: its replies get standard output's descriptor to
# themselves, and whatever else prints (a loader's notice) goes to standard error.
_REPLIES = """
import json as _json, os as _os, sys as _sys
_replies = _os.fdopen(_os.dup(1), "w")
_os.dup2(2, 1)
def reply(message):
    _replies.write(_json.dumps(message) + "\\n")
    _replies.flush()
def requests():
    return (_json.loads(line) for line in _sys.stdin)
"""


@contextlib.contextmanager
def conversation(code: str, path: Path, payload) -> Iterator[Callable[[object], object]]:
    """A new Python process running ``code`` as ``python -c code PATH PAYLOAD`` (PAYLOAD
    a file holding ``payload``), kept for a conversation: the block gets ``ask``, which
    sends a message (JSON) and returns the process's answer. ``code`` answers each of
    ``requests()`` with ``reply(message)``, once it is ready for it: the process and
    this one can take turns on the machine. ``NewProcessFailed`` when it dies or takes
    over ``TIMEOUT_S`` in all; it is ended when the block is."""
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bladesmith-talk-")))
        torch.save(payload, folder / "payload.pt")
        errors = stack.enter_context(open(folder / "stderr.txt", "w+"))
        child = subprocess.Popen(
            [sys.executable, "-c", _REPLIES + code, str(path), str(folder / "payload.pt")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=_child_env(),
        )
        # A reader thread gives readline a time limit on every platform (select takes no
        # pipes on Windows); it shuts down after the process has ended.
        reader = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="bladesmith-talk"))
        stack.callback(_end, child)
        deadline = time.monotonic() + TIMEOUT_S

        def ask(message):
            try:
                child.stdin.write(json.dumps(message) + "\n")
                child.stdin.flush()
            except BrokenPipeError:
                pass  # it ended: its exit status and last error line say why, below
            answer = reader.submit(child.stdout.readline)
            try:
                line = answer.result(timeout=max(deadline - time.monotonic(), 0))
            except FutureTimeout:
                child.kill()  # the readline then ends, and the reader with it
                raise NewProcessFailed(_too_long()) from None
            if line:
                return json.loads(line)
            errors.seek(0)
            raise NewProcessFailed(_why(child.wait(), errors.read()))

        yield ask


def _end(child: subprocess.Popen) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        child.stdin.close()  # its requests() end, and it exits
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _too_long() -> str:
    return f"loading and running it in a new process took over {TIMEOUT_S} s"


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def reload_problem(optimized, path: Path) -> str | None:
    """Why the artifact at ``path`` is not ``optimized`` (it does not load and run in a
    new process, or its outputs on a test input of each signature differ past the spec's
    tolerance there), or None when it is."""
    from bladesmith.runtimes.built_for import describe_tensors, signature
    from bladesmith.verify import compare_outputs, detection_score_tolerance, precisions

    calls = optimized.verified_args
    outputs, problem = run_saved_each(path, calls)
    if problem is not None:
        return f"it does not load back: {problem}"
    spec = optimized.spec
    rtol, atol = spec.tolerance.get("rtol"), spec.tolerance.get("atol")
    # Detection scores as the gate judged them: what the dtype computed in may move them.
    judged_at = rtol + atol if rtol is not None and atol is not None else 0.0
    computes_in = precisions.named(spec.dtype).dtype or torch.float32  # int8: no torch dtype
    score_atol = detection_score_tolerance(computes_in, judged_at)
    for args, got in zip(calls, outputs, strict=True):
        comparison = compare_outputs(
            optimized(*args), got, rtol=rtol, atol=atol, score_atol=score_atol
        )
        if not comparison.passed:
            at = f" at {describe_tensors(signature(args))}" if len(calls) > 1 else ""
            return f"loaded back, its outputs{at} differ: {comparison.summary()}"
    return None


def _why(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"a new process loading it was killed by {name} (torch's loader crashed)"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {returncode}"
    return f"a new process could not load and run it ({last})"
