"""The `bladesmith` command line: help, and `bladesmith doctor` in text and JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

from bladesmith.cli import EXIT_BROKEN_PIPE, build_parser, main
from bladesmith.devices import DeviceInfo
from bladesmith.environment import DoctorResult, OpsStatus, Package, Pitfall, Tool, Toolchain

doctor_module = importlib.import_module("bladesmith.environment")


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    assert "doctor" in capsys.readouterr().out


def test_help_does_not_import_torch():
    code = (
        "import sys; from bladesmith.cli import build_parser; build_parser().format_help(); "
        "print(sorted({'torch', 'onnxruntime', 'rich'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_doctor_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    assert "Exit status: 0 when no pitfall has severity error, 1 when" in capsys.readouterr().out


def expected_exit(report: dict) -> int:
    return 1 if any(pitfall["severity"] == "error" for pitfall in report["pitfalls"]) else 0


def test_doctor_json_in_process(capsys):
    code = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {
        "platform",
        "packages",
        "devices",
        "providers",
        "toolchain",
        "pitfalls",
        "formats",
    }
    assert code == expected_exit(report)


def test_python_m_bladesmith_doctor_json():
    done = subprocess.run(
        [sys.executable, "-m", "bladesmith", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert report["devices"][-1]["name"] == "cpu"
    assert done.returncode == expected_exit(report), done.stderr


def test_doctor_exits_1_for_a_binary_pth_in_a_named_site_dir(tmp_path, capsys):
    weights = tmp_path / "model.pth"
    weights.write_bytes(b"\x80\x02}q\x00binary weights")
    assert main(["doctor", "--json", "--site-dir", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    [pitfall] = [p for p in report["pitfalls"] if p["id"] == "binary-pth"]
    assert str(weights) in pitfall["message"] and "model.pt" in pitfall["fix"]


def fake_result(*pitfalls: Pitfall) -> DoctorResult:
    return DoctorResult(
        platform="Linux-test",
        packages=[
            Package("torch", "2.11.0+cu130", "CUDA 13.0"),
            Package("onnx", None),
        ],
        devices=[
            DeviceInfo("cuda:0", "cuda", "NVIDIA H200", 141 * 2**30, "9.0"),
            DeviceInfo("cpu", "cpu", "Fancy CPU", logical_cores=16, torch_threads=8),
        ],
        providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
        toolchain=Toolchain(
            compiler=Tool("C++ compiler", "/usr/bin/c++", "c++ 12.2.0"),
            ninja=Tool("ninja", None, None, "not on PATH"),
            nvcc=Tool("nvcc", "/usr/local/cuda/bin/nvcc", "12.8.93"),
            torch_cuda="13.0",
            nvcc_cuda="12.8",
            nvcc_matches_torch=False,
            ops=OpsStatus(True, True, "/cache/[v1]/ops.so", True, "cached"),
        ),
        pitfalls=list(pitfalls),
    )


def test_doctor_table_shows_every_section(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")
    warning = Pitfall("no-ninja", "warning", "ninja is missing", "pip install ninja")
    monkeypatch.setattr(doctor_module, "doctor", lambda site_dirs: fake_result(warning))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for text in (
        "2.11.0+cu130",
        "not installed",
        "NVIDIA H200",
        "compute capability 9.0, 141.0 GiB",
        "16 logical cores, torch threads 8",
        "CUDAExecutionProvider, CPUExecutionProvider",
        "does not match torch's CUDA 13.0",
        "/cache/[v1]/ops.so",  # printed as text, not read as rich markup
        "built, loads",
        "no-ninja",
        "pip install ninja",
    ):
        assert text in out, text


def test_doctor_exit_status_follows_errors_only(monkeypatch, capsys):
    error = Pitfall("torch-missing", "error", "torch is not installed", "install it")
    monkeypatch.setattr(doctor_module, "doctor", lambda site_dirs: fake_result(error))
    assert main(["doctor", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["pitfalls"][0]["id"] == "torch-missing"
    monkeypatch.setattr(doctor_module, "doctor", lambda site_dirs: fake_result())
    assert main(["doctor"]) == 0
    assert "No pitfalls found." in capsys.readouterr().out


def test_bare_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_argument_types_name_what_they_expect():
    import argparse

    from bladesmith.cli.args import at_least, input_size

    assert input_size("480x640") == (480, 640) and input_size("32X48") == (32, 48)
    for bad in ("480", "0x640", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="480x640|positive"):
            input_size(bad)
    assert at_least(1)("3") == 3 and at_least(0)("0") == 0
    for bad in ("0", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="integer"):
            at_least(1)(bad)


def test_a_closed_stdout_ends_a_command_that_prints_through_rich_quietly():
    """`bladesmith doctor | true`: rich's own handler exited 1."""

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails with EPIPE
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bladesmith", "doctor"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert done.stderr.decode() == ""
    assert done.returncode == EXIT_BROKEN_PIPE


def _commands(parser, path=()):
    """(command path, its parser) for every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_command_taking_load_library_defines_it_alike():
    flags = {
        " ".join(path): action
        for path, sub in _commands(build_parser())
        for action in sub._actions
        if "--load-library" in action.option_strings
    }
    assert {"optimize", "bench", "export onnx", "export triton", "serve"} <= flags.keys()
    for command, action in flags.items():
        assert action.metavar == "PATH" and action.default == [], command
        assert action.help.startswith("a shared library of the model's own operators"), command
        assert action.help.endswith("; repeatable"), command
