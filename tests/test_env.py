"""``redline.env`` names every ``REDLINE_*`` environment variable, and the product names them only through it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import redline
from redline import env

SRC = Path(redline.__file__).parent
ENV_MODULE = SRC / "env.py"
VARIABLES = {name: value for name, value in vars(env).items() if name.startswith("REDLINE_")}


def _product_modules() -> list[Path]:
    return [path for path in sorted(SRC.rglob("*.py")) if path != ENV_MODULE]


def test_each_constant_is_named_as_its_variable_and_said_what_it_means() -> None:
    assert VARIABLES, "env.py names no variable"
    assert all(name == value for name, value in VARIABLES.items())
    lines = ENV_MODULE.read_text(encoding="utf-8").splitlines()
    for name in VARIABLES:
        (index,) = [i for i, line in enumerate(lines) if line.startswith(f"{name} = ")]
        assert lines[index - 1].startswith("# "), f"{name} has no comment above it saying what it means"


def test_no_redline_variable_is_written_as_a_literal_outside_env() -> None:
    """A quoted ``"REDLINE_...`` anywhere, or a string constant that is a variable's name, outside env.py."""
    found = []
    for path in _product_modules():
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(SRC)}: {m.group()}" for m in re.finditer(r"[\"']REDLINE_\w*", text)]
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"REDLINE_\w+", node.value)
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value}")
    assert found == []


def test_every_variable_named_is_read_by_the_product() -> None:
    """Imported by a module, or read in env.py itself (where state lives: ``state_dir``)."""
    imported = {
        node.id
        for node in ast.walk(ast.parse(ENV_MODULE.read_text(encoding="utf-8")))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    for path in _product_modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "redline.env":
                imported |= {alias.name for alias in node.names}
    assert set(VARIABLES) <= imported, f"named in env.py, read nowhere: {set(VARIABLES) - imported}"
    assert env.QUEUE_OOM_RECORD == "oom.json"  # the file the queue's tests write by its literal name
