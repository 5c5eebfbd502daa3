"""All terminal output goes through here: one stdout console for results, one stderr console for errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from redline.errors import BadInput
from redline.hw.snapshot import Gpu

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colour, no wrapping, safe to pipe into jq."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(message: str) -> None:
    err_console.print(f"[bold red]redline:[/] {message}", highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    err_console.print(f"[yellow]redline:[/] {message}", highlight=False, soft_wrap=True)


def write_text_file(path: Path, text: str) -> None:
    """Write a report or snapshot; refuse to replace a directory, say why in one line on failure."""
    if path.is_dir():
        raise BadInput(f"{path} is a directory; give a file name")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None


def key_value_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, str(value))
    return table


def gpu_line(gpu: Gpu) -> str:
    """One line per GPU, like nvidia-smi -L with the numbers that matter for throughput."""
    if gpu.lost:
        return f"[red]GPU {gpu.index}: lost ({gpu.pci_bus_id})[/]"
    parts = [
        f"GPU {gpu.index}: {gpu.name}",
        gpu.pci_bus_id or "",
        f"PCIe Gen{gpu.pcie.gen_current} x{gpu.pcie.width_current}",
        f"{gpu.power.draw_w or 0:.0f}/{gpu.power.enforced_limit_w or 0:.0f} W",
        f"{gpu.thermal.temperature_c} °C",
        f"SM {gpu.clocks.sm_mhz}/{gpu.clocks.sm_max_mhz} MHz",
    ]
    return "  ".join(p for p in parts if p)
