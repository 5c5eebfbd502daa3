"""``one_line``: every exception the product tells in a message, a note or a table cell, told one way."""

from __future__ import annotations

import pytest

from redline.errors import one_line


class Quiet(Exception):
    """An exception raised with no text."""


@pytest.mark.parametrize(
    ("exc", "typed", "expected"),
    [
        (ValueError("bad value"), True, "ValueError: bad value"),
        (ValueError("bad value"), False, "bad value"),
        (Quiet(), True, "Quiet"),  # no text: its type, typed or not
        (Quiet(), False, "Quiet"),
        (Quiet("  \n\n  "), True, "Quiet"),  # blank lines are no text either
        # a worker's traceback in the message: its headline only
        (RuntimeError("\n  first   line\nTraceback (most recent call last):\n  x"), True, "RuntimeError: first line"),
        (OSError(2, "No such file or directory"), False, "[Errno 2] No such file or directory"),
        (KeyError("strategy"), True, "KeyError: 'strategy'"),
    ],
)
def test_an_exception_is_its_type_and_headline(exc: BaseException, typed: bool, expected: str) -> None:
    assert one_line(exc, typed=typed) == expected


def test_a_long_headline_is_cut_with_an_ellipsis() -> None:
    told = one_line(ValueError("x" * 1000))
    assert len(told) == 300 and told.startswith("ValueError: xxx") and told.endswith("...")
    assert one_line(ValueError("x" * 1000), limit_chars=40) == "ValueError: " + "x" * 25 + "..."
    assert one_line(ValueError("x" * 28), limit_chars=40) == "ValueError: " + "x" * 28  # exactly the limit: kept


def test_the_line_is_always_one() -> None:
    for text in ("a\nb", "a\r\nb", "\ta \x0b b", "line\u2028next"):
        assert "\n" not in one_line(ValueError(text)) and "\r" not in one_line(ValueError(text))
