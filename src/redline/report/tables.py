"""The style of the tables that list figures (the plan's ranked and cloud tables, the presets, the catalog)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table


def listing(**options: Any) -> Table:
    """A table with a rule under its header and no frame, no padding at its edges and none doubled between
    columns, so a row of figures fits 80 columns; ``options`` are rich ``Table``'s (title, caption, padding)."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, **options)
