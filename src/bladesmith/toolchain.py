"""The tools that build bladesmith's operator library, found the way torch finds them.

``torch.utils.cpp_extension`` compiles with ``$CXX`` (else ``c++``; ``cl`` on Windows),
runs ninja from PATH and nvcc from the CUDA toolkit at CUDA_HOME. The doctor reports
these tools and the ops build checks for them before it starts: both ask this module,
so they cannot disagree. Only the standard library is imported here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_IS_WINDOWS = os.name == "nt"


@dataclass
class Tool:
    name: str
    path: str | None  # None: not found
    version: str | None
    detail: str = ""


def compiler_name() -> str:
    """The C++ compiler torch builds with: $CXX, else c++ (cl on Windows)."""
    return os.environ.get("CXX") or ("cl" if _IS_WINDOWS else "c++")


def find_compiler() -> Tool:
    wanted = compiler_name()
    path = shutil.which(wanted)
    if path:
        command = [path] if Path(path).stem.lower() == "cl" else [path, "--version"]
        version = _first_line(_tool_output(command))
        return Tool("C++ compiler", path, version, f"torch builds with {wanted}")
    others = [name for name in ("c++", "g++", "clang++", "cl") if shutil.which(name)]
    detail = f"torch builds with {wanted}, not on PATH"
    if others:
        detail += f"; found {', '.join(others)} (set CXX={others[0]})"
    return Tool("C++ compiler", None, None, detail)


def find_ninja() -> Tool:
    path = shutil.which("ninja")
    if path:
        return Tool("ninja", path, _first_line(_tool_output([path, "--version"])))
    # pip installs ninja into the environment's scripts directory, which is on PATH only
    # while the environment is activated; torch looks for it on PATH.
    scripts = Path(sysconfig.get_path("scripts"))
    beside = scripts / ("ninja.exe" if _IS_WINDOWS else "ninja")
    if beside.is_file():
        return Tool("ninja", None, None, f"{beside} exists but {scripts} is not on PATH")
    return Tool("ninja", None, None, "not on PATH")


def cuda_home() -> str | None:
    """CUDA_HOME as torch.utils.cpp_extension computes it (read now, not at its import)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).parent.parent)
    if _IS_WINDOWS:
        homes = sorted(Path("C:/Program Files/NVIDIA GPU Computing Toolkit/CUDA").glob("v*.*"))
        return str(homes[0]) if homes else None
    return "/usr/local/cuda" if Path("/usr/local/cuda").exists() else None


def nvcc_path(home: str | None) -> Path | None:
    """The nvcc of the CUDA toolkit at ``home``, if it has one."""
    if home is None:
        return None
    nvcc = Path(home, "bin", "nvcc.exe" if _IS_WINDOWS else "nvcc")
    return nvcc if nvcc.is_file() else None


def find_nvcc() -> Tool:
    home = cuda_home()
    if home is None:
        return Tool("nvcc", None, None, "no CUDA toolkit (CUDA_HOME, PATH, /usr/local/cuda)")
    nvcc = nvcc_path(home)
    if nvcc is None:
        name = "nvcc.exe" if _IS_WINDOWS else "nvcc"
        return Tool("nvcc", None, None, f"CUDA_HOME={home} has no bin/{name}")
    text = _tool_output([str(nvcc), "--version"])
    if text is None:
        return Tool("nvcc", str(nvcc), None, "does not run")
    version = re.search(r"V(\d+\.\d+(?:\.\d+)?)", text) or re.search(r"release (\d+\.\d+)", text)
    return Tool("nvcc", str(nvcc), version[1] if version else None, f"CUDA_HOME={home}")


def _tool_output(command: list[str]) -> str | None:
    """What a tool prints about itself (stdout, then stderr), or None when it cannot run."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, errors="replace", timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout + done.stderr


def _first_line(text: str | None) -> str | None:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else None
