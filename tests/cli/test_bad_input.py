"""Every CLI command against a table of bad inputs: exit code 2, one line on stderr that
names the file or flag, no traceback (``--debug`` shows it)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from bladesmith.cli import main

SMALL_BUILTIN = "torchvision:retinanet_resnet18_fpn"


class Fixed(nn.Module):
    """Takes 3x8x8 images only: a flattening linear layer fixes the input size."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3 * 8 * 8, 2)

    def forward(self, images):
        return self.linear(images.flatten(1))


# Each file the table names, as {key} in argv; the error line must name the file.
_NAMES = {
    "missing": "missing.pt",
    "directory": "folder.pt",
    "empty": "empty.pt",
    "random": "random.pt",
    "random_pt2": "random.pt2",
    "zip": "notes.pt",
    "model": "conv.pt",
    "fixed": "fixed.pt",
    "corrupt": "corrupt.pt",
    "tensor": "tensor.pt",
    "state_dict": "linear_state.pt",
    "checkpoint": "checkpoint.pth",
    "onnx": "identity.onnx",
    "gray": "gray.pt",
    "pickled": "pickled_model.pt",
    "unwritable": "no/such/folder/out",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_inputs")
    f = {key: root / name for key, name in _NAMES.items()}
    f["directory"].mkdir()
    f["empty"].write_bytes(b"")
    f["random"].write_bytes(random.Random(0).randbytes(4096))
    f["random_pt2"].write_bytes(random.Random(1).randbytes(4096))
    with zipfile.ZipFile(f["zip"], "w") as archive:
        archive.writestr("readme.txt", "not a model")
    torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())).save(str(f["model"]))
    torch.jit.script(Fixed()).save(str(f["fixed"]))
    f["corrupt"].write_bytes(f["model"].read_bytes()[:2000])
    torch.save(torch.zeros(3), f["tensor"])
    gray = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())  # 1-channel images only
    torch.jit.trace(gray, torch.rand(1, 1, 8, 8)).save(str(f["gray"]))
    torch.save(nn.Sequential(nn.Conv2d(3, 4, 3)), f["pickled"])  # torch.save(model)
    torch.save(nn.Linear(2, 2).state_dict(), f["state_dict"])
    torch.save({"model": nn.Linear(2, 2).state_dict(), "epoch": 3}, f["checkpoint"])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    onnx.save(helper.make_model(graph), f["onnx"])
    return f


def _table() -> list[tuple[str, str, str]]:
    """(case id, command line with {file} keys, what the error line must name)."""
    cases = []
    unreadable = ["missing", "directory", "empty", "random", "zip", "corrupt", "tensor"]
    unreadable.append("random_pt2")  # torch.export.load logged its traceback first
    for key in [*unreadable, "onnx"]:
        cases.append((f"optimize-{key}", f"optimize {{{key}}}", key))
        cases.append((f"bench-{key}", f"bench {{{key}}}", key))
    for key in unreadable:
        cases.append((f"export-{key}", f"export onnx {{{key}}} o.onnx", key))
    for key in [*unreadable, "model"]:
        cases.append((f"check-{key}", f"check {{{key}}} --target ort-cpu", key))
        cases.append((f"fix-{key}", f"fix {{{key}}} o.onnx -t ort-cpu", key))
    for key in ["missing", "directory", "random", "tensor", "model", "state_dict", "checkpoint"]:
        cases.append((f"weights-{key}", f"optimize {SMALL_BUILTIN} --weights {{{key}}}", key))
    for flag, suffix in (("--report", ".json"), ("--chart", ".png"), ("--out", ".pt")):
        cases += [
            (
                f"optimize-unwritable{flag}",
                f"optimize {{model}} {flag} {{unwritable}}{suffix}",
                flag,
            ),
            (f"optimize-directory{flag}", f"optimize {{model}} {flag} {{directory}}", flag),
            (f"demo-unwritable{flag}", f"demo {flag} {{unwritable}}{suffix}", flag),
        ]
    cases += [
        ("bench-not-an-artifact", "bench {model}", "model"),
        (
            "export-weights-missing",
            "export onnx torchvision:retinanet_resnet50_fpn o.onnx --weights {missing}",
            "missing",
        ),
        ("weights-for-a-model-file", "optimize {model} --weights {state_dict}", "--weights"),
        ("optimize-out-unknown-suffix", "optimize {model} --out m.txt", "--out"),
        ("optimize-torchscript-out-pt2", "optimize {model} --out m.pt2", "--out"),
        ("optimize-report-in-proc", "optimize {model} --report /proc/report.json", "--report"),
        ("optimize-chart-in-proc", "optimize {model} --chart /proc/chart.png", "--chart"),
        ("bench-unwritable-json", "bench {model} --json {unwritable}.json", "--json"),
        ("fix-unwritable-output", "fix {onnx} {unwritable}.onnx -t ort-cpu", "output"),
        ("fix-output-a-directory", "fix {onnx} {directory} -t ort-cpu", "output"),
        ("export-unwritable-output", "export onnx {model} {unwritable}.onnx", "OUT"),
        ("doctor-site-dir-missing", "doctor --site-dir {missing}", "--site-dir"),
        ("doctor-site-dir-a-file", "doctor --site-dir {model}", "--site-dir"),
        ("optimize-wrong-input-size", "optimize {fixed} --input-size 16x16", "--input-size"),
        ("optimize-wrong-channels", "optimize {gray} --input-size 16x16", "--input-size"),
        ("export-wrong-channels", "export onnx {gray} o.onnx --input-size 16x16", "--input-size"),
        ("optimize-pickled-model", "optimize {pickled}", "pickled"),
        ("weights-pickled-model", f"optimize {SMALL_BUILTIN} --weights {{pickled}}", "pickled"),
        ("optimize-unknown-builtin", "optimize torchvision:nonsense", "nonsense"),
        ("optimize-iters-0", "optimize {model} --iters 0", "--iters"),
        ("optimize-warmup-negative", "optimize {model} --warmup -1", "--warmup"),
        ("optimize-input-size-zero", "optimize {model} --input-size 0x5", "--input-size"),
        ("optimize-input-size-word", "optimize {model} --input-size big", "--input-size"),
        ("optimize-level", "optimize {model} --level o9", "--level"),
        ("optimize-device", "optimize {model} --device quantum", "quantum"),
        ("optimize-exclude", "optimize {model} --exclude no_such_pass", "no_such_pass"),
        ("optimize-unknown-flag", "optimize {model} --frobnicate", "--frobnicate"),
        ("demo-batch-0", "demo --batch 0", "--batch"),
        ("optimize-batch-twice", "optimize {model} --batch 2,2", "--batch"),
        ("optimize-batch-word", "optimize {model} --batch 1,many", "--batch"),
        ("demo-missing-gpu", "demo --device cuda:99", "cuda:99"),
        ("bench-iters-word", "bench --iters x {model}", "--iters"),
        ("bench-nothing", "bench", "ARTIFACT"),
        ("doctor-unknown-flag", "doctor --frobnicate", "--frobnicate"),
        ("ops-unknown-action", "ops frobnicate", "frobnicate"),
        ("check-unknown-target", "check {onnx} --target quantum", "quantum"),
        ("check-no-target", "check {onnx}", "--target"),
        ("fix-input-shape", "fix {onnx} o.onnx -t ort-cpu --input-shape x", "--input-shape"),
        ("export-opset-word", "export onnx {model} o.onnx --opset seven", "--opset"),
        ("export-opset-too-new", "export onnx {model} o.onnx --opset 99", "--opset"),
        ("export-an-onnx-model", "export onnx {onnx} o.onnx", "onnx"),
        (
            "fix-input-shape-zero",
            "fix {onnx} o.onnx -t ort-cpu --input-shape x:0,3",
            "--input-shape",
        ),
        (
            "fix-input-shape-rank",
            "fix {onnx} o.onnx -t ort-cpu --input-shape x:1,3,8",
            "--input-shape",
        ),
        ("fix-output-is-the-input", "fix {onnx} {onnx} -t ort-cpu", "onnx"),
        ("export-unknown-format", "export tflite {model} o.tflite", "tflite"),
        ("unknown-command", "frobnicate", "frobnicate"),
        # Test images past the memory available: refused before any is made.
        ("optimize-huge-side", "optimize {model} --input-size 99999999999x1", "--input-size"),
        ("optimize-huge-batch", "optimize {model} --batch 100000000", "--batch"),
        (
            "export-huge-side",
            "export onnx {model} o.onnx --input-size 99999999999x1",
            "--input-size",
        ),
        ("export-huge-batch", "export onnx {model} o.onnx --batch 100000000", "--batch"),
    ]
    return cases


_CASES = {case_id: (line, names) for case_id, line, names in _table()}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case_id", list(_CASES))
def test_bad_input_gets_one_line_and_exit_code_2(case_id, files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative outputs ("o.onnx") land in the test's folder
    line, names = _CASES[case_id]
    argv = [word.format(**files) for word in line.split()]
    code, err = _run(argv, capsys)
    lines = [text for text in err.splitlines() if text.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    expected = files[names].name if names in files else names
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize(
    "line", ["optimize {gray} --input-size 16x16", "export onnx {gray} o.onnx --input-size 16x16"]
)
def test_a_torchscript_models_own_error_is_its_cause_in_one_short_line(
    line, files, capsys, monkeypatch, tmp_path
):
    """TorchScript's message is its stack, then the error: once the cause was empty
    (optimize: "RuntimeError:;"), or the whole stack folded into ~2,500 characters
    (export). The line names the file, the cause and the flags, and nothing else."""
    monkeypatch.chdir(tmp_path)
    code, err = _run([word.format(**files) for word in line.split()], capsys)
    (error,) = [text for text in err.splitlines() if text.strip()]
    assert code == 2 and files["gray"].name in error and "--batch" in error, error
    assert "to have 1 channels, but got 3 channels instead" in error, error
    assert "RGB images" in error, error  # what the command line feeds it
    assert "HERE" not in error and len(error) < 500, error  # one line, not a stack


def test_a_pickled_model_is_named_as_one_with_what_to_save_instead(files, capsys):
    code, err = _run(["optimize", str(files["pickled"])], capsys)
    assert code == 2
    assert "a pickled torch.nn.modules.container.Sequential (torch.save(model))" in err, err
    assert "torch.jit.trace" in err and "torch.export.save" in err and "state dict" not in err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_a_file_without_permission(files, capsys, tmp_path):
    locked = tmp_path / "locked.pt"
    locked.write_bytes(files["model"].read_bytes())
    locked.chmod(0)
    for argv in (
        ["optimize", str(locked)],
        ["bench", str(locked)],
        ["check", str(locked), "-t", "all"],
    ):
        code, err = _run(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "locked.pt" in err and "permission" in err.lower()


def test_wrapped_checkpoint_is_unwrapped_and_the_mismatch_summarised(files, capsys):
    code, err = _run(["optimize", SMALL_BUILTIN, "--weights", str(files["checkpoint"])], capsys)
    assert code == 2
    assert "'model'" in err  # it looked inside the checkpoint
    assert len(err) < 600  # a summary, not every key


def test_the_real_entry_point_and_debug(files):
    """``python -m bladesmith``: one line without --debug, the traceback with it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "bladesmith", "bench", str(files["random"])]
    quiet = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 2
    assert quiet.stderr.count("\n") == 1 and "Traceback" not in quiet.stderr
    loud = subprocess.run(
        [*argv[:3], "--debug", *argv[3:]], capture_output=True, text=True, timeout=300, env=env
    )
    assert loud.returncode == 2
    assert "Traceback" in loud.stderr and "random.pt" in loud.stderr


@pytest.mark.parametrize("key", ["missing", "directory", "empty", "random", "zip", "corrupt"])
def test_load_of_a_bad_file_is_one_clear_error(key, files):
    import bladesmith
    from bladesmith.errors import BladesmithError

    with pytest.raises(BladesmithError) as raised:
        bladesmith.load(files[key])
    message = str(raised.value)
    assert files[key].name in message and "\n" not in message and len(message) < 400


def test_images_past_the_memory_available_are_refused_and_a_large_fit_is_said(
    files, capsys, monkeypatch
):
    """The limit is the memory available now, not a fixed size: 64 images of 64x64
    (3 MiB) refused where 2 MiB are available, and said on stderr where they fit but
    pass the noted size."""
    from bladesmith.cli import args

    monkeypatch.setattr(args, "available_memory", lambda: 2 << 20)
    code, err = _run(
        ["optimize", str(files["model"]), "--batch", "64", "--input-size", "64x64"], capsys
    )
    assert code == 2 and "3.0 MiB of test images, more than the 2.0 MiB" in err, err
    monkeypatch.setattr(args, "available_memory", lambda: 1 << 40)
    monkeypatch.setattr(args, "IMAGES_NOTED_BYTES", 1 << 20)
    args.check_images_fit((64,), (64, 64))
    assert "making 3.0 MiB of test images" in capsys.readouterr().err
