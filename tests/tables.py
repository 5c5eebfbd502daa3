"""What a table's reader needs at any width: every value whole on one line, nothing cut with an ellipsis."""

from __future__ import annotations

WIDTHS = (80, 120)  # a pipe, a job log or a default SSH window; a wide terminal


def assert_whole(text: str, *values: str, width: int | None = None) -> None:
    """Each of ``values`` appears unbroken on one line of ``text``; no cell was cut (no "…"); no line is wider
    than ``width`` when given."""
    lines = text.splitlines()
    assert "…" not in text, f"a cell was cut:\n{text}"
    for value in values:
        assert any(value in line for line in lines), f"{value!r} is not whole on any line:\n{text}"
    if width is not None:
        wide = [line for line in lines if len(line.rstrip()) > width]
        assert not wide, f"lines wider than {width}: {wide}"
