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


_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_count(text: str) -> float:
    """'7e9', '7B', '300b', '1.5T', '2M', '1_000' -> a number; ValueError with the reason otherwise."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    match = re.fullmatch(r"([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgtp]?)", cleaned, re.IGNORECASE)
    if not match:
        raise ValueError(f"'{text}' is not a count (examples: 7e9, 7B, 300B, 1.5T)")
    try:
        value = float(match.group(1)) * _COUNT_SUFFIX[match.group(2).lower()]
    except ValueError:  # "1.2.3"
        raise ValueError(f"'{text}' is not a count (examples: 7e9, 7B, 300B, 1.5T)") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"'{text}' must be a positive, finite count")
    return value


def fmt_count(n: float) -> str:
    """6738415616 -> '6.74B', 524288 -> '524k', 2.2e15 -> '2.2P' (a big model's FLOPs per sequence)."""
    for suffix, size in (("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.3g}"


_BYTE_SUFFIX = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'20G', '20GiB', '512M', '1.5T' -> bytes, binary as `nvidia-smi` and Slurm's --mem count them ('20GB' is
    decimal: 20e9); ValueError with the reason otherwise."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(i?b)?", text.strip(), re.IGNORECASE)
    example = "(examples: 20G, 20GiB, 512M)"
    if not match:
        raise ValueError(f"'{text}' is not a size {example}")
    prefix, unit = match.group(2).lower(), (match.group(3) or "").lower()
    scale = 1000 ** "_kmgt".index(prefix) if unit == "b" and prefix else _BYTE_SUFFIX[prefix]
    try:
        value = float(match.group(1)) * scale
    except ValueError:
        raise ValueError(f"'{text}' is not a size {example}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"'{text}' must be a positive size")
    return int(value)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, *, bare_unit_s: float = 1.0) -> float:
    """'90s', '10m', '36h', '7d', '2w' -> seconds; a bare number counts in ``bare_unit_s``. ValueError with
    the reason otherwise."""
    cleaned = text.strip().lower()
    try:
        value = (
            float(cleaned[:-1]) * _DURATION_UNITS[cleaned[-1]]
            if cleaned[-1:] in _DURATION_UNITS
            else float(cleaned) * bare_unit_s
        )
    except ValueError:
        raise ValueError(f"'{text}' is not a duration like 90s, 10m, 36h or 7d") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"'{text}' must be a positive, finite duration")
    return value


def fmt_duration(seconds: float | None) -> str:
    """Human durations: '850 ms', '42.0 s', '3.2 h', '12.5 d'."""
    if seconds is None:
        return "n/a"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
