"""ui.print_table: a table that fits is printed as a table; one that would cut a cell is stacked, whole."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from redline.cli import ui
from tables import WIDTHS, assert_whole


def _printed(table: Table, width: int) -> str:
    buffer = io.StringIO()
    ui.print_table(table, out=Console(file=buffer, width=width, markup=False, color_system=None))
    return buffer.getvalue()


def _prices() -> Table:
    table = Table(title="instances")
    for header in ("instance", "GPUs", "hours", "cost", "notes"):
        table.add_column(header, no_wrap=header != "notes")
    table.add_row("p5.48xlarge (8x H100 SXM5 80GB)", "8", "212.5", "$17,432.10", Text("* price unverified"))
    table.add_row("a2-ultragpu-8g (8x A100 80GB)", "8", "401.0", "$16,120.55", "")
    return table


@pytest.mark.parametrize("width", WIDTHS)
def test_no_number_name_or_mark_is_cut_at_any_width(width: int) -> None:
    text = _printed(_prices(), width)
    assert_whole(text, "p5.48xlarge (8x H100 SXM5 80GB)", "$17,432.10", "$16,120.55", "unverified")
    assert_whole(text, "212.5", "401.0", width=width)


def test_a_table_that_fits_stays_a_table_and_one_that_does_not_is_stacked() -> None:
    wide, narrow = _printed(_prices(), 120), _printed(_prices(), 60)
    assert "┃ instance" in wide  # the header row of a table
    assert "  cost:  $17,432.10" in narrow and "  notes: * price unverified" in narrow
    assert "notes:" not in narrow.split("a2-ultragpu-8g")[1]  # an empty cell says nothing


def test_rich_alone_would_cut_what_print_table_keeps() -> None:
    """The finding: the same table through rich at 60 columns loses digits of its cost."""
    buffer = io.StringIO()
    Console(file=buffer, width=60, color_system=None).print(_prices())
    assert "$17,432.10" not in buffer.getvalue()
