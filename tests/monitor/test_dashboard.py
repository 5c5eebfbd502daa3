"""The live view at the widths people's terminals have: every column that carries a finding is on screen,
whole, at 80 and at 120 columns; only the busy history and the bars give way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from fakes.traces import scenario
from redline.monitor.dashboard import reason_label, render
from redline.monitor.diagnose import diagnose
from redline.units import fmt_bytes


def screen(samples, width: int) -> list[str]:
    steps = {st.rank: st for s in samples for st in s.steps}
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(render(samples, diagnose(samples), steps, "redline monitor"))
    return captured.get().splitlines()


def gpu_rows(lines: list[str], gpus: int) -> dict[int, list[str]]:
    """Each GPU's lines: its row, then the continuation lines of a wrapped clock-events cell."""
    header = next(i for i, line in enumerate(lines) if line.startswith("GPU "))
    rows: dict[int, list[str]] = {}
    for line in lines[header + 1 :]:
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if first.isdigit() and int(first) == len(rows):
            rows[int(first)] = [line]
        elif line.startswith(" " * 20) and rows:  # a wrapped cell
            rows[len(rows) - 1].append(line.strip())
        else:
            break
    assert len(rows) == gpus, lines
    return rows


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("name", ["throttling", "power_cap", "pcie_downgrade", "foreign_process"])
def test_every_column_that_carries_a_finding_stays_whole(tmp_path: Path, name: str, width: int) -> None:
    samples = scenario(name, root=tmp_path, ticks=40).run()
    lines = screen(samples, width)
    assert all(len(line) <= width for line in lines)
    rows = gpu_rows(lines, len(samples[-1].gpus))
    header = next(line for line in lines if line.startswith("GPU "))
    for column in ("memory", "SM MHz", "W", "°C", "PCIe", "clock events", "procs"):
        assert column in header, header
    for gpu in samples[-1].gpus:
        row = " ".join(rows[gpu.index])
        assert "…" not in row and "..." not in row, row
        expected = [
            f"{gpu.sm_clock_hertz / 1e6:.0f}/{gpu.sm_clock_max_hertz / 1e6:.0f}",
            f"{gpu.power_watts:.0f}/{gpu.power_limit_watts:.0f}",
            f" {gpu.temperature_celsius:.0f} ",
            fmt_bytes(gpu.memory_used_bytes),
            f"gen{gpu.pcie_link_generation} x{gpu.pcie_link_width}",
            *(reason_label(r) for r in gpu.clock_event_reasons if r not in ("gpu_idle",)),
        ]
        for text in expected:
            assert text in row, (text, row)
        assert rows[gpu.index][0].rstrip().endswith(f" {len(gpu.processes)}"), row


def test_the_history_gives_way_before_the_bars(tmp_path: Path) -> None:
    samples = scenario("healthy", root=tmp_path, ticks=40).run()
    wide, narrow = screen(samples, 200), screen(samples, 80)
    history = re.compile(r"% [▁▂▃▄▅▆▇█ ]{8,}")  # a sparkline after the busy bar's percentage
    assert "busy (recent)" in wide[1] and history.search(wide[2])
    assert "busy (recent)" not in narrow[1] and "█" not in narrow[2]  # at 80 the numbers alone
    middle = screen(samples, 100)
    assert "█" in middle[2] and not history.search(middle[2])  # the bars kept, the history gone
