"""Counts as the CLI prints and reads them: a suffix per thousand, the same ones both ways."""

import pytest

from redline.units import fmt_count, parse_count


@pytest.mark.parametrize(
    ("value", "shown"),
    [(999, "999"), (524288, "524k"), (6738415616, "6.74B"), (1.5e12, "1.5T"), (2.2e15, "2.2P"), (3e18, "3e+03P")],
)
def test_a_count_is_shown_with_the_largest_suffix_it_reaches(value: float, shown: str) -> None:
    assert fmt_count(value) == shown


@pytest.mark.parametrize("value", [524e3, 6.74e9, 1.5e12, 2.2e15])
def test_what_is_shown_reads_back(value: float) -> None:
    assert parse_count(fmt_count(value)) == pytest.approx(value)
