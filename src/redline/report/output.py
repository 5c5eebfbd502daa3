"""Writing what redline produces (a snapshot, a plan, an HTML report) to a file the user named."""

from __future__ import annotations

import os
from pathlib import Path

from redline.errors import BadInput


def write_output(path: Path, text: str, *, marker: str, protect: Path | None = None) -> None:
    """Write a report or snapshot without ever destroying something the user had.

    An existing file is replaced only if redline wrote it (its head contains ``marker``); the input
    snapshot (``protect``) is never replaced. The write goes to a temporary file renamed over the target,
    so an interrupted run leaves the old file whole.
    """
    try:
        if path.is_dir():
            raise BadInput(f"{path} is a directory; give a file name")
        if protect is not None and path.resolve() == protect.resolve():
            raise BadInput(f"refusing to overwrite the input snapshot {path}")
        exists = path.exists()
    except OSError as exc:  # a folder this user may not look into
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None
    if exists and marker not in _head(path):
        raise BadInput(f"{path} exists and was not written by redline; remove it or choose another name")
    tmp = path.with_name(f".{path.name}.redline-tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None


def _head(path: Path, size: int = 512) -> str:
    try:
        with path.open("rb") as f:
            return f.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""
