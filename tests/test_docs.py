"""The documentation stays true to the tree: every module docs/ARCHITECTURE.md names exists
(and every top-level module is named there), every source path and relative link in the
README and docs/ resolves, and the README and ARCHITECTURE stay short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "bladesmith"
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FILE = re.compile(r"[\w./*-]*\w\.(?:py|h|cpp|cu|cuh|json)\b")
FOLDER = re.compile(r"(?<![\w.<])[a-z_]+/(?:[a-z_]+/)*(?![\w.*])")
DOTTED = re.compile(r"`((?:_?[a-z]+\.)+(?!(?:py|h|cpp|cu|cuh|json|md)\b)[A-Za-z_]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Paths the pages name that are no files of this repository: what a command writes
# (a Triton repository, an artifact's libraries) and other projects' documents.
ELSEWHERE = ("model.py", "libraries.json", "docs/OperatorKernels.md")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```\n(.*?)```", text, re.DOTALL)


def exists(name: str, *bases: Path) -> bool:
    """Whether `name` (a path, possibly with a glob) is a file or folder under one of the bases."""
    name = name.rstrip("/")
    for base in bases:
        if any(base.glob(name)) or (base / name).exists():
            return True
    return False


def module_tree() -> list[tuple[Path, str]]:
    """(folder, text) for each entry of the module tree: an entry's own name and the files
    and folders its description names, resolved inside that entry's folder."""
    tree = next(
        block for block in code_blocks(ARCHITECTURE.read_text()) if "src/bladesmith/" in block
    )
    entries: list[tuple[Path, str]] = []
    for line in tree.splitlines()[1:]:
        match = re.match(r"(\S+)\s*(.*)", line.strip())
        if line.startswith("  ") and not line.startswith("   "):  # an entry of src/bladesmith/
            name = match.group(1)
            folder = PACKAGE / name if name.endswith("/") else PACKAGE
            entries.append((folder, line))
        elif not line.startswith(" "):  # tests/, benchmarks/
            entries.append((ROOT / match.group(1), line))
        else:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line)
    return entries


def test_every_module_in_the_tree_exists():
    missing = []
    for folder, text in module_tree():
        entry = text.split()[0]
        if not (ROOT / entry).exists() and not (PACKAGE / entry).exists():
            missing.append(entry)
        for name in FILE.findall(text) + FOLDER.findall(text):
            if name in ELSEWHERE:
                continue
            found = any(folder.rglob(name.rstrip("/"))) if folder.is_dir() else False
            if not found and not exists(name, PACKAGE, ROOT):
                missing.append(f"{entry} {name}")
    assert not missing, f"docs/ARCHITECTURE.md names what the tree lacks: {missing}"


def test_every_top_level_module_is_in_the_tree():
    named = {text.split()[0] for _, text in module_tree()}
    modules = {path.name for path in PACKAGE.glob("*.py")}
    packages = {f"{path.name}/" for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    unnamed = sorted((modules | packages) - named)
    assert not unnamed, f"add these to docs/ARCHITECTURE.md's tree: {unnamed}"


def test_the_layers_name_modules_that_exist():
    text = ARCHITECTURE.read_text()
    layers = code_blocks(text)[0]
    leaves = re.sub(
        r"\(.*?\)", "", layers[layers.index("leaves:") + len("leaves:") :], flags=re.DOTALL
    )
    names = re.findall(r"[a-z_]+/?", leaves)
    folders = re.findall(r"^ (\w+/)", layers, re.MULTILINE)
    missing = [
        name
        for name in names + folders
        if not exists(name, PACKAGE) and not exists(f"{name}.py", PACKAGE)
    ]
    assert not missing, f"docs/ARCHITECTURE.md's layers name what the tree lacks: {missing}"


def test_every_path_and_dotted_name_in_architecture_exists():
    text = ARCHITECTURE.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    missing = []
    for name in re.findall(r"`([^`]+)`", prose):
        for path in FILE.findall(name) + FOLDER.findall(name):
            bases = (PACKAGE, ROOT, PACKAGE / "ops", PACKAGE / "onnx", ROOT / "tests")
            if path not in ELSEWHERE and not exists(path, *bases):
                missing.append(path)
    for dotted in DOTTED.findall(prose):
        *parts, attribute = dotted.split(".")
        module = PACKAGE.joinpath(*parts)
        source = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
        if module.is_dir() or source.exists():
            if not re.search(rf"\b{attribute}\b", source.read_text()):
                missing.append(dotted)
    assert not missing, f"docs/ARCHITECTURE.md names what the code lacks: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_source_paths_in_a_page_exist(page):
    missing = []
    for path in re.findall(
        r"(?<![\w/.-])((?:src|bladesmith|tests|benchmarks|csrc|\.ci)/[\w./*-]*\w)", page.read_text()
    ):
        path = path.split("::")[0]
        bases = (ROOT, ROOT / "src", PACKAGE / "ops")
        if path not in ELSEWHERE and not exists(path, *bases):
            missing.append(path)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    headings = re.findall(
        r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL), re.MULTILINE
    )
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_between_pages_resolve(page):
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"\w+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and anchor not in anchors(target)):
            broken.append(link)
    assert not broken, f"{page.name} links to what is not there: {broken}"


def test_the_readme_and_architecture_fit_on_a_screen_or_two():
    assert len(README.read_text().splitlines()) < 200
    assert len(ARCHITECTURE.read_text().splitlines()) < 250


def test_the_readme_keeps_the_two_commands_that_dev_runs():
    dev = (ROOT / "dev").read_text()
    readme = README.read_text()
    for job in ("demo", "test"):
        assert f"    {job})" in dev and f"./dev {job}" in readme
