"""A small disk for the tests of what happens when one fills up: a tmpfs mounted for the test, unmounted after."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: str = "16m") -> Iterator[Path]:
    """``path`` as the mount point of a tmpfs of ``size`` (root only: skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small disk needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True)


def fill(folder: Path) -> Path:
    """A file that takes every free byte of ``folder``'s disk; remove it to give the room back."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = 1 << 20
        while size:  # ever smaller writes once a write no longer fits: to the last byte
            try:
                os.write(fd, bytes(size))
            except OSError:
                size //= 2
    finally:
        os.close(fd)
    return filler
