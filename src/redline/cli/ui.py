"""All terminal output goes through here: one stdout console for results, one stderr console for errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from redline.errors import BadInput
from redline.hw.snapshot import Gpu

# markup is off: hostnames, paths, /sys contents and user arguments are printed as they are, never parsed
# as rich markup ("[/]" in a path must not crash the error path). Styles go through Text.
console = Console(markup=False)
err_console = Console(stderr=True, markup=False)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colour, no wrapping, safe to pipe into jq."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(message: str) -> None:
    err_console.print(Text.assemble(("redline: ", "bold red"), message), highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    err_console.print(Text.assemble(("redline: ", "yellow"), message), highlight=False, soft_wrap=True)


def write_output(path: Path, text: str, *, marker: str, protect: Path | None = None) -> None:
    """Write a report or snapshot without ever destroying something the user had.

    An existing file is replaced only if redline wrote it (its head contains ``marker``); the input
    snapshot (``protect``) is never replaced. The write goes to a temporary file renamed over the target,
    so an interrupted run leaves the old file whole.
    """
    if path.is_dir():
        raise BadInput(f"{path} is a directory; give a file name")
    if protect is not None and path.resolve() == protect.resolve():
        raise BadInput(f"refusing to overwrite the input snapshot {path}")
    if path.exists() and marker not in _head(path):
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


def key_value_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, str(value))
    return table


def dim(message: str) -> Text:
    return Text(message, style="dim")


def gpu_line(gpu: Gpu) -> Text:
    """One line per GPU, like nvidia-smi -L with the numbers that matter for throughput."""
    if gpu.lost:
        return Text(f"GPU {gpu.index}: lost ({gpu.pci_bus_id})", style="red")
    parts = [
        f"GPU {gpu.index}: {gpu.name}",
        gpu.pci_bus_id or "",
        f"PCIe Gen{gpu.pcie.gen_current} x{gpu.pcie.width_current}",
        f"{gpu.power.draw_w or 0:.0f}/{gpu.power.enforced_limit_w or 0:.0f} W",
        f"{gpu.thermal.temperature_c} °C",
        f"SM {gpu.clocks.sm_mhz}/{gpu.clocks.sm_max_mhz} MHz",
    ]
    return Text("  ".join(p for p in parts if p))
