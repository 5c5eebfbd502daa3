"""The one place that reads /sys and /proc.

Every read goes through a ``SysFs`` whose ``root`` defaults to ``/``; tests point it at a fake tree.
A missing file reads as ``None`` (absence is a value); a file that exists but holds garbage also reads
as ``None`` and leaves a one-line note in ``errors``, so the probe can report it and carry on.
"""

from __future__ import annotations

import os
from pathlib import Path


class SysFs:
    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)
        self.errors: list[str] = []

    def path(self, path: str) -> Path:
        """The real location of an absolute /sys or /proc path under this root."""
        return self.root / path.lstrip("/")

    def exists(self, path: str) -> bool:
        return self.path(path).exists()

    def read(self, path: str) -> str | None:
        """The file's text, stripped; None if it is absent or unreadable."""
        try:
            return self.path(path).read_text(encoding="utf-8", errors="replace").strip()
        except (OSError, ValueError):
            return None

    def read_lines(self, path: str) -> list[str]:
        text = self.read(path)
        return text.splitlines() if text else []

    def read_int(self, path: str, base: int = 10) -> int | None:
        text = self.read(path)
        if text is None or text == "":
            return None
        try:
            return int(text.split()[0], base)
        except ValueError:
            self.errors.append(f"{path}: {text[:40]!r} is not a number")
            return None

    def read_float(self, path: str) -> float | None:
        text = self.read(path)
        if text is None or text == "":
            return None
        try:
            return float(text.split()[0])
        except ValueError:
            self.errors.append(f"{path}: {text[:40]!r} is not a number")
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(path)))
        except OSError:
            return []

    def link_name(self, path: str) -> str | None:
        """The last component of a symlink's target (e.g. the driver behind device/driver)."""
        try:
            return Path(os.readlink(self.path(path))).name
        except OSError:
            return None

    def resolve(self, path: str) -> str | None:
        """Where a symlink really points, as an absolute path inside this root ('/sys/devices/...')."""
        real = self.path(path)
        if not real.exists():
            return None
        try:
            return "/" + str(real.resolve().relative_to(self.root.resolve()))
        except ValueError:
            return None

    def read_kv(self, path: str, sep: str | None = None) -> dict[str, str]:
        """Lines of 'key value' (or 'key: value') as a dict: /proc/meminfo, cgroup stat files."""
        out: dict[str, str] = {}
        for line in self.read_lines(path):
            key, _, value = line.partition(sep) if sep else line.partition(" ")
            out[key.strip().rstrip(":")] = value.strip()
        return out
