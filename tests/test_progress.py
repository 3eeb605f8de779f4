"""Progress when stdout and stderr are not a terminal: plain lines, one per pass with its
verdict, from the README's Python example and from the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# What keeps these runs short: small photographs, few timed runs, only the passes that
# rebuild the detector and change its layout.
SLOW_PASSES = ("winograd", "norm_folding", "torchscript", "onnxruntime")
QUICK_FLAGS = ["--input-size", "128x160", "--warmup", "0", "--iters", "2"]
for name in SLOW_PASSES:
    QUICK_FLAGS += ["--exclude", name]
PASS_LINE = re.compile(r"^bladesmith: (kept|rejected|failed|skipped) [a-z0-9_]+: ")


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=900, env=env, cwd=cwd, check=False
    )


def _pass_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if PASS_LINE.match(line)]


def readme_example() -> str:
    """The README's Python example under 'Optimize', as written."""
    text = README.read_text()
    section = text[text.index("## Optimize") :]
    return section[section.index("```python\n") + 10 : section.index("```\n", 10)]


@pytest.mark.slow
def test_the_readme_example_prints_a_line_per_pass_when_piped(tmp_path):
    code = readme_example()
    assert "(480, 640)" in code and "bladesmith.optimize(" in code
    # The same calls, sooner: a lighter backbone, small photographs, few timed runs.
    config = f"bladesmith.Config(warmup=0, iters=2, exclude={SLOW_PASSES})"
    quick = f"import bladesmith\n{config}.__enter__()\n"
    # Saving is left out: with two timed runs on a loaded machine the result may be the
    # model as given (never slower), which torchvision's detector cannot be saved as.
    code = "\n".join(line for line in code.splitlines() if "bladesmith.save" not in line
                      and "bladesmith.load" not in line)  # fmt: skip
    script = quick + code.replace(
        "build_retinanet((480, 640))", "build_retinanet((128, 160), backbone='resnet18')"
    ).replace("(480, 640)", "(128, 160)")
    done = _run([sys.executable, "-c", script], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _pass_lines(done.stderr)
    assert any(line.startswith("bladesmith: ") and " fixed_shape: " in line for line in lines), (
        done.stderr
    )
    assert len(lines) >= 2
    assert any(line.startswith("bladesmith: result: ") for line in done.stderr.splitlines())
    assert "\r" not in done.stderr and "\x1b[" not in done.stderr  # no spinner, no colours


@pytest.mark.slow
def test_the_demo_prints_a_line_per_pass_when_piped(tmp_path):
    argv = [sys.executable, "-m", "bladesmith", "demo", "--device", "cpu", *QUICK_FLAGS]
    done = _run(argv, cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: accuracy failed, reported
    lines = _pass_lines(done.stderr)
    assert any(line.startswith("bladesmith: kept fixed_shape: ") for line in lines), done.stderr
    assert "\r" not in done.stderr and "\x1b[" not in done.stderr
    assert "The artifact" in done.stdout


def test_a_result_in_doubt_says_so_on_its_line(capsys):
    import dataclasses
    import time

    from bladesmith import bench
    from bladesmith.progress import Progress

    progress = Progress(enabled=True)
    progress.lines = True  # as when stderr is piped
    speedup = bench.compare(lambda: time.sleep(0.001), lambda: None, warmup=0, iters=2)
    progress.done(dataclasses.replace(speedup, doubts=()))
    assert "in doubt" not in capsys.readouterr().err
    progress.done(dataclasses.replace(speedup, doubts=("a timing artefact",)))
    assert capsys.readouterr().err.rstrip().endswith("(in doubt: see the report's diagnosis)")
