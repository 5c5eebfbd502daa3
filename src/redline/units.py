"""Unit constants and human formatting, so no module spells 1024**3 or '%.1f GB' twice."""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 1000**3


def fmt_bytes(n: float | None) -> str:
    """Binary units, as free/df/nvidia-smi print them: '64.0 MiB', '79.6 GiB'."""
    if n is None:
        return "n/a"
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_index_list(indices: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5': compact GPU lists for 8-GPU servers."""
    out: list[str] = []
    start = prev = None
    for i in sorted(indices):
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.21.5' -> (2, 21, 5); '12.4' -> (12, 4); '2.5.1+cu124' -> (2, 5, 1): leading digits of each part."""
    parts = []
    for piece in text.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)
