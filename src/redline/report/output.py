"""Writing what redline produces (a snapshot, a plan, an HTML report, a plot) to a file the user named."""

from __future__ import annotations

import os
from pathlib import Path

from redline.errors import BadInput
from redline.files import open_regular, refuse_non_regular


def write_output(
    path: Path, content: str | bytes, *, marker: str, protect: Path | None = None, protected: str = "the input snapshot"
) -> None:
    """Write a report or snapshot without ever destroying something the user had.

    An existing file is replaced only if redline wrote it (its head contains ``marker``); the input
    (``protect``, said as ``protected``) is never replaced. The write goes to a temporary file renamed over the
    target, so an interrupted run leaves the old file whole.
    """
    check_target(path, marker=marker, protect=protect, protected=protected)
    tmp = path.with_name(f".{path.name}.redline-tmp")
    try:
        tmp.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None


def check_target(
    path: Path, *, marker: str, protect: Path | None = None, protected: str = "the input snapshot"
) -> None:
    """The rules ``write_output`` applies, for a caller to check before a long render rather than after it:
    never a folder, never the input, never a file redline did not write, never a FIFO or a device (whose open
    would block, or which would swallow the output)."""
    try:
        if path.is_dir():
            raise BadInput(f"{path} is a directory; give a file name")
        refuse_non_regular(path, "output file")
        if protect is not None and path.resolve() == protect.resolve():
            raise BadInput(f"refusing to overwrite {protected} {path}")
        exists = path.exists()
    except OSError as exc:  # a folder this user may not look into
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None
    if exists and marker.encode("utf-8") not in _head(path):
        raise BadInput(f"{path} exists and was not written by redline; remove it or choose another name")


def _head(path: Path, size: int = 512) -> bytes:
    try:
        fd = open_regular(path, "output file")  # not blocking, should a FIFO have come in its place since
    except BadInput:
        return b""
    try:
        return os.read(fd, size)
    except OSError:
        return b""
    finally:
        os.close(fd)
