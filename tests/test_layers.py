"""No package of redline imports one above it: hw and specs at the bottom, cli at the top (see the README's
"How it is built"). Every import in every module counts, also those inside functions and under TYPE_CHECKING:
an import dodged into a function is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import redline

SRC = Path(redline.__file__).parent

# lowest first; a package may import its own layer and those below it
LAYERS = [
    {"errors", "units", "capability", "lockfile", "files", "env"},
    {"hw", "specs"},
    {"workload"},
    {"bench"},
    {"transfer"},
    {"plan"},
    {"doctor"},
    {"report"},
    {"monitor"},
    {"runtime"},
    {"tune"},
    {"infer"},
    {"queue"},
    {"cli", "__main__", "__init__"},
]
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}

# upward imports not yet removed, each with the module that makes it; this list may only shrink
KNOWN: set[tuple[str, str, str]] = set()


def _package(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0].removesuffix(".py")


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name.split(".")[1] for name in names if name.startswith("redline.")}


def upward_imports() -> set[tuple[str, str, str]]:
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        package = _package(path)
        for target in _imported(ast.parse(path.read_text(encoding="utf-8"))) - {package}:
            if LEVEL[target] > LEVEL[package]:
                found.add((package, target, str(path.relative_to(SRC))))
    return found


def test_every_package_has_a_layer() -> None:
    packages = {_package(path) for path in SRC.rglob("*.py")}
    assert packages - LEVEL.keys() == set(), "a new package: give it a layer in LAYERS"


def test_no_package_imports_one_above_it() -> None:
    assert upward_imports() == KNOWN


def test_the_walk_sees_an_upward_import(tmp_path: Path) -> None:
    tree = ast.parse("def f():\n    from redline.cli.ui import console\n")
    assert _imported(tree) == {"cli"}
