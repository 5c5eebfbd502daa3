"""The live view at the widths people's terminals have: every column that carries a finding is on screen,
whole, at 80 and at 120 columns; only the busy history and the bars give way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from fakes.traces import scenario
from redline.cli.monitor import _sample_line
from redline.monitor.dashboard import reason_label, render
from redline.monitor.diagnose import diagnose
from redline.report.wrap import Values, prose
from redline.units import fmt_bytes, fmt_duration
from tables import WIDTHS, assert_whole


def screen(samples, width: int) -> list[str]:
    steps = {st.rank: st for s in samples for st in s.steps}
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(render(samples, diagnose(samples), steps, ["redline monitor", "every 1 s"]))
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


def rate(value: float | None) -> str:
    return f"{fmt_bytes(value)}/s"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["swapping", "throttling"])
def test_the_host_steps_and_findings_lines_wrap_between_values(tmp_path: Path, name: str, width: int) -> None:
    samples = scenario(name, root=tmp_path, ticks=40).run()
    host = samples[-1].host
    assert host is not None
    text = "\n".join(screen(samples, width))
    assert_whole(
        text,
        f"mem {fmt_bytes(host.memory_used_bytes)}/{fmt_bytes(host.memory_total_bytes)}",
        f"swap {fmt_bytes(host.swap_used_bytes)}",
        f"disk r/w {rate(host.disk_read_bytes_per_second)} {rate(host.disk_write_bytes_per_second)}",
        f"net rx/tx {rate(host.network_rx_bytes_per_second)} {rate(host.network_tx_bytes_per_second)}",
        width=width,
    )
    latest = {st.rank: st for s in samples for st in s.steps}
    if latest:  # past four ranks, one line for them all and one for the rank whose own work is longest
        slow = max(latest.values(), key=lambda st: st.data_s + st.compute_s + st.optimizer_s)
        assert_whole(text, f"{len(latest)} ranks: step", f"rank {slow.rank}: step {slow.step}")
        assert_whole(text, f"{fmt_duration(slow.time_s)}/step", f"loss {slow.loss:.4g}")
    for finding in diagnose(samples):  # a number stays with its unit ("40.0 s", "90 °C", "306.6 MiB/s")
        assert_whole(text, *(value for value in prose(finding.title) if " " in value))


@pytest.mark.parametrize("width", WIDTHS)
def test_a_sample_line_in_a_pipe_wraps_between_gpus(tmp_path: Path, width: int) -> None:
    samples = scenario("throttling", root=tmp_path, ticks=40).run()
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(_sample_line(samples[-1], diagnose(samples)))
    text = captured.get()
    gpus = [
        f"gpu{g.index} {100 * g.utilization_ratio:.0f}% {g.memory_used_bytes / 2**30:.1f}GiB" for g in samples[-1].gpus
    ]
    assert_whole(text, *gpus, "fail monitor.thermal", width=width)
    assert text.splitlines()[0].split()[0].count(":") == 2  # each sample starts with its time; the rest indented
    assert all(line.startswith("  ") for line in text.splitlines()[1:])


def test_values_fill_each_line_and_break_only_a_value_wider_than_it() -> None:
    values = Values(["alpha 1", "beta 22", "gamma 333", "delta 4444"])
    assert [line.plain for line in values.lines(20)] == ["alpha 1 | beta 22", "  gamma 333", "  delta 4444"]
    assert [line.plain for line in values.lines(80)] == ["alpha 1 | beta 22 | gamma 333 | delta 4444"]
    console = Console(width=12, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(Values(["a", "a-value-longer-than-the-line"]))
    assert all(len(line) <= 12 for line in captured.get().splitlines())
    assert prose("SM clock 1980 → 1544 MHz, on GPU 2 at 90 °C") == [
        "SM",
        "clock",
        "1980 → 1544 MHz,",
        "on",
        "GPU 2",
        "at",
        "90 °C",
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_a_sample_line_in_a_pipe_carries_each_ranks_newest_step(tmp_path: Path, width: int) -> None:
    """`redline monitor | tee log` beside a run: the quick start's walk saw only "cpu 100%" lines in the log while
    the run trained; each line names each rank's newest step since the last sample, whole."""
    from redline.monitor.sample import StepSample

    sample = scenario("throttling", root=tmp_path, ticks=3).run()[-1]
    sample.steps = [
        StepSample(rank=0, step=25, time_s=1.2, data_s=0.0, compute_s=1.0, optimizer_s=0.2, loss=2.5),
        StepSample(rank=0, step=26, time_s=1.6, data_s=0.0, compute_s=1.2, optimizer_s=0.4, loss=2.179),
        StepSample(rank=1, step=26, time_s=1.5, data_s=0.1, compute_s=1.2, optimizer_s=0.2, loss=2.18),
    ]
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(_sample_line(sample, []))
    text = captured.get()
    assert_whole(text, "rank0 step 26 1.6 s/step loss 2.179", "rank1 step 26 1.5 s/step loss 2.18", width=width)
    assert "step 25" not in text
