"""All terminal output goes through here: one stdout console for results, one stderr console for errors."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colour, no wrapping, safe to pipe into jq."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(message: str) -> None:
    err_console.print(f"[bold red]redline:[/] {message}", highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    err_console.print(f"[yellow]redline:[/] {message}", highlight=False, soft_wrap=True)
