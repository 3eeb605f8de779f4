"""bladesmith's public names stay what they are when their modules are imported first."""

from __future__ import annotations

import subprocess
import sys

import bladesmith


def test_no_public_function_is_shadowed_by_its_module():
    """``import bladesmith.X`` sets the package's attribute X to the module: a public
    function named like its own module would then stop being callable."""
    functions = {n: m for n, (m, a) in bladesmith._EXPORTS.items() if a is not None}
    code = (
        "import importlib, types, bladesmith\n"
        f"for module in {sorted(set(functions.values()))!r}:\n"
        "    importlib.import_module(module)\n"
        f"print([n for n in {sorted(functions)!r}"
        " if isinstance(getattr(bladesmith, n), types.ModuleType)])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]"
    assert callable(bladesmith.doctor) and callable(bladesmith.save)
