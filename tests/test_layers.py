"""How redline's packages may import one another (docs/architecture.md, "Layers"): the foundation at the
bottom, then the core in the order data flows through it (hw and specs, workload, bench, plan, runtime), the
views that judge and show what the core measures (doctor, report, monitor), the four applications built on all
of that (transfer, tune, infer, queue), which never import one another, and the CLI on top. Every import in
every module counts, also those inside functions and under TYPE_CHECKING: an import dodged into a function is
still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import redline

SRC = Path(redline.__file__).parent

FOUNDATION = [{"errors", "units", "capability", "lockfile", "files", "env"}]
CORE = [{"hw", "specs"}, {"workload"}, {"bench"}, {"plan"}, {"runtime"}]
VIEWS = [{"doctor"}, {"report"}, {"monitor"}]
# one layer, but each is its own program over the layers below: none may import another
APPLICATIONS = {"transfer", "tune", "infer", "queue"}
ENTRY = {"cli", "__main__", "__init__"}

# lowest first; a package may import its own layer and those below it
LAYERS = [*FOUNDATION, *CORE, *VIEWS, APPLICATIONS, ENTRY]
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}

# the modules that draw on a terminal: rich is theirs alone, so what the others return is data a caller renders
RENDERERS = ("cli/", "report/", "monitor/dashboard.py", "infer/report.py")

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


def imports_between_packages() -> set[tuple[str, str, str]]:
    """(importing package, imported package, module) for every import of one package by another."""
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        package = _package(path)
        for target in _imported(ast.parse(path.read_text(encoding="utf-8"))) - {package}:
            found.add((package, target, str(path.relative_to(SRC))))
    return found


def upward_imports() -> set[tuple[str, str, str]]:
    return {edge for edge in imports_between_packages() if LEVEL[edge[1]] > LEVEL[edge[0]]}


def imports_between_applications() -> set[tuple[str, str, str]]:
    return {edge for edge in imports_between_packages() if {edge[0], edge[1]} <= APPLICATIONS}


def test_every_package_has_a_layer() -> None:
    packages = {_package(path) for path in SRC.rglob("*.py")}
    assert packages - LEVEL.keys() == set(), "a new package: give it a layer in LAYERS"


def test_no_package_imports_one_above_it() -> None:
    assert upward_imports() == KNOWN


def test_no_application_imports_another() -> None:
    # what two applications share belongs in the core or a view, where both can import it
    assert imports_between_applications() == set()


def test_the_layers_are_those_the_architecture_page_draws() -> None:
    page = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    for packages in LAYERS:
        for package in packages - {"__main__", "__init__"}:
            assert f"`{package}`" in page, f"docs/architecture.md does not place {package}"


def test_only_the_renderers_import_rich() -> None:
    drawing = set()
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if not module.startswith(RENDERERS) and _imports_rich(ast.parse(path.read_text(encoding="utf-8"))):
            drawing.add(module)
    assert drawing == set(), "rich outside the renderers: return data and let cli/ or report/ draw it"


def _imports_rich(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if any(name == "rich" or name.startswith("rich.") for name in names):
            return True
    return False


def test_the_walk_sees_rich() -> None:
    assert _imports_rich(ast.parse("def f():\n    from rich.table import Table\n"))
    assert not _imports_rich(ast.parse("import richer\n"))


def test_the_walk_sees_an_upward_import(tmp_path: Path) -> None:
    tree = ast.parse("def f():\n    from redline.cli.ui import console\n")
    assert _imported(tree) == {"cli"}
