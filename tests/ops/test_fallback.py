"""Devices with no kernel of their own run the operators on the CPU and get the results
back (fallback.cpp): DirectML's PrivateUse1, played by a device written in Python."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.backend_registration as backend_registration


@pytest.mark.skipif(
    not hasattr(backend_registration, "_setup_privateuseone_for_python_backend")
    or not hasattr(torch._C, "_acc"),
    reason="this torch cannot define a PrivateUse1 device in Python",
)
def test_operators_run_on_a_device_without_kernels():
    script = Path(__file__).with_name("python_device.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
