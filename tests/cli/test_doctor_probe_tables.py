"""`redline doctor`, `doctor --list-rules` and `redline probe` read whole at 80 and 120 columns, and the live
probe says how busy other processes keep the CPUs."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, run_cli
from redline.doctor.engine import all_rules
from tables import WIDTHS, assert_whole


@pytest.mark.parametrize("width", WIDTHS)
def test_list_rules_is_one_line_per_rule_at_any_width(width):
    proc = run_cli("doctor", "--list-rules", columns=width)
    assert proc.returncode == 0, proc.stderr
    rules = all_rules()
    assert_whole(proc.stdout, *(r.id for r in rules), *{r.area.heading for r in rules}, width=width)
    lines = proc.stdout.splitlines()
    for r in rules:  # a table row: the id, then the start of what it checks, on one line
        assert any(line.split()[:2] == [r.id, r.summary.split()[0]] for line in lines if line.strip()), r.id


@pytest.mark.parametrize("width", WIDTHS)
def test_doctor_report_fits_the_width(width):
    proc = run_cli("doctor", "--from", str(FIXTURES / "h100x8-faulty.json"), columns=width)
    assert proc.returncode == 0, proc.stderr
    assert_whole(proc.stdout, "8 x NVIDIA H100 80GB HBM3", "redline doctor --list-rules", width=width)


@pytest.mark.parametrize("width", WIDTHS)
def test_probe_table_is_whole_and_says_how_busy_the_cpus_are(width):
    proc = run_cli("probe", columns=width)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.split()[:2] == ["cpu", "use"])
    assert "others " in row and " CPUs over " in row
    assert_whole(proc.stdout, "logical cores", "full snapshot: redline probe --json", width=width)
