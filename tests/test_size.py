"""No module of redline over 800 lines, no function over 80 (from its ``def`` to the end of its body): past
that a reader no longer sees a module's concern or a function's steps at once (issue #15)."""

from __future__ import annotations

import ast
from pathlib import Path

import redline

SRC = Path(redline.__file__).parent
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones too, by qualified name (``Class.method``, ``outer.inner``)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                found.append((name, node))
            found += _functions(node, f"{name}.")
        else:
            found += _functions(node, prefix)
    return found


def long_files() -> dict[str, int]:
    """Modules over the limit, by path under src/redline, with their line counts."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            found[path.relative_to(SRC).as_posix()] = lines
    return found


def long_functions() -> dict[tuple[str, str], int]:
    """Functions over the limit, by (path under src/redline, qualified name), with their line counts (the
    ``def`` line to the last of the body; decorators not counted)."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name, node in _functions(tree):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found[(path.relative_to(SRC).as_posix(), name)] = lines
    return found


def test_no_module_is_over_800_lines() -> None:
    offenders = long_files()
    listed = ", ".join(f"{path} ({lines} lines)" for path, lines in offenders.items())
    assert not offenders, f"over {MAX_FILE_LINES} lines: {listed}; split it by concern"


def test_no_function_is_over_80_lines() -> None:
    offenders = long_functions()
    listed = ", ".join(f"{path} {name} ({lines} lines)" for (path, name), lines in offenders.items())
    assert not offenders, f"over {MAX_FUNCTION_LINES} lines: {listed}; split it into named steps"


def test_the_counts_are_of_def_to_the_end_of_the_body() -> None:
    source = (
        "@decorator\ndef outer():\n    def inner():\n        pass\n\n    return inner\n\n\n"
        "class C:\n    def m(self):\n        pass\n"
    )
    counted = {name: node.end_lineno - node.lineno + 1 for name, node in _functions(ast.parse(source))}
    assert counted == {"outer": 5, "outer.inner": 2, "C.m": 2}
