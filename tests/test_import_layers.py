"""Each module imports only its own layer and those below it (docs/ARCHITECTURE.md's
layout), read from the source with ``ast``: top-level and function-level imports alike,
and the names a module reaches through the lazy ``bladesmith`` package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "bladesmith"

# Low to high; a module may import its own layer and any lower one.
LAYERS = [
    {"errors", "_files", "progress", "config", "spec", "bench", "report", "devices",
     "toolchain", "environment", "images", "convs", "models.weights", "typed_outputs",
     "trust"},
    {"verify"},
    {"ops"},
    {"onnx"},
    {"runtimes", "families", "fresh_load"},
    {"artifact", "models"},
    {"passes"},
    {"engine"},
    {"serve"},
    {"cli", "__main__", "bladesmith"},
]  # fmt: skip


def _layer(module: str) -> int:
    """The layer of ``bladesmith.X.Y``: its longest listed prefix (X.Y, else X)."""
    parts = module.split(".")[1:] or ["bladesmith"]
    for length in range(len(parts), 0, -1):
        name = ".".join(parts[:length])
        for index, layer in enumerate(LAYERS):
            if name in layer:
                return index
    raise AssertionError(f"{module}: in no layer of this test; add it to LAYERS")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_names() -> dict[str, str]:
    """The root package's lazy names (``bladesmith.load``) and the module of each."""
    tree = ast.parse((SOURCE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            exports = ast.literal_eval(node.value)
            return {name: module for name, (module, _) in exports.items()}
    raise AssertionError("bladesmith/__init__.py: no _EXPORTS")


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """The bladesmith modules ``path`` (its text: ``source``) imports."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    lazy = _lazy_names()
    found, bare_root = set(), False
    tree = ast.parse(source if source is not None else path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "bladesmith":
                    bare_root = True
                elif alias.name.startswith("bladesmith."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if base == "bladesmith":  # from bladesmith import ops, load, __version__
                for alias in node.names:
                    if not alias.name.startswith("__"):  # the package's own: no import
                        found.add(lazy.get(alias.name, f"bladesmith.{alias.name}"))
            elif base.startswith("bladesmith."):
                found.add(base)
    if bare_root:  # `import bladesmith` then bladesmith.load(...)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "bladesmith"
                and not node.attr.startswith("__")
            ):
                found.add(lazy.get(node.attr, f"bladesmith.{node.attr}"))
    return found


def upward_imports() -> list[str]:
    wrong = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = _module_name(path)
        for imported in sorted(imports_of(path)):
            if imported.startswith(module + "."):
                continue
            if _layer(imported) > _layer(module):
                wrong.append(f"{module} imports {imported}")
    return wrong


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports() == []


def test_the_engine_names_no_pass():
    """The engine reaches passes through their contract (the registry and the candidate),
    never through a pass's own module."""
    contract = {"bladesmith.passes", "bladesmith.passes.registry", "bladesmith.passes.candidate"}
    named = [
        f"{_module_name(path)} imports {imported}"
        for path in sorted((SOURCE / "engine").glob("*.py"))
        for imported in sorted(imports_of(path))
        if imported.startswith("bladesmith.passes.") and imported not in contract
    ]
    assert named == []


@pytest.mark.parametrize(
    ("source", "imported"),
    [
        ("from bladesmith.engine.progress import Progress\n", "bladesmith.engine.progress"),
        ("import bladesmith\nbladesmith.optimize(model)\n", "bladesmith.engine"),
        ("from bladesmith import serve\n", "bladesmith.serve"),
        ("from ..passes import ORDER\n", "bladesmith.passes"),
    ],
)
def test_the_check_sees_each_form_of_import(source, imported):
    module = SOURCE / "runtimes" / "_probe.py"
    assert imported in imports_of(module, source)
    assert _layer(imported) > _layer("bladesmith.runtimes._probe")
