"""The terminal view of `redline monitor`: one screen, redrawn each interval, readable over SSH.

Per GPU a row: utilisation as a bar and a sparkline of the recent window, memory, SM clock against its max,
power against its limit, temperature, PCIe link, the clock-event reasons that are set, processes. Then one
line for the host, one per training rank, and the active findings of the diagnosis. Plain rich renderables
built from ``Sample``s, so the same code draws a live screen (rich ``Live``) and a one-off print.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from redline.doctor.model import Finding, Severity
from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample
from redline.report.wrap import Values, prose
from redline.units import fmt_bytes, fmt_count, fmt_duration

SPARK = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 10
SPARK_WIDTH = 30
MIN_SPARK_WIDTH = 8  # fewer readings than this show no trend: the history is left out instead
MAX_RANK_LINES = 4
# reasons that only say the GPU has nothing to do, or sits where a setting put it: not worth a column
QUIET_REASONS = frozenset({"gpu_idle", "applications_clocks_setting", "display_clock_setting"})
# clock-event reasons as the table names them (nvidia-smi's words, shortened so a set one fits at 80 columns)
REASON_LABELS = {
    "sw_power_cap": "power cap",
    "hw_slowdown": "HW slowdown",
    "sync_boost": "sync boost",
    "sw_thermal_slowdown": "SW thermal",
    "hw_thermal_slowdown": "HW thermal",
    "hw_power_brake_slowdown": "power brake",
    "board_limit": "board limit",
}
COLUMNS = (  # header, justify
    ("GPU", "right"),
    ("busy", "left"),
    ("memory", "left"),
    ("SM MHz", "right"),
    ("W", "right"),
    ("°C", "right"),
    ("PCIe", "left"),
    ("clock events", "left"),
    ("procs", "right"),
)
_EVENTS = 7  # the clock-events column: the one that may wrap, one reason to a line at the narrowest
COLUMN_GAP = 2  # padding (0, 1) without the outer edges: two spaces between columns
FINDING_INDENT = 7  # a finding's lines after its first start under its title, past the " WARN " badge
SEVERITY_STYLE = {Severity.FAIL: "bold white on red", Severity.WARN: "bold black on yellow", Severity.INFO: "blue"}


def bar(ratio: float | None, width: int = BAR_WIDTH) -> Text:
    """'███████░░░  72%'; ' 72%' alone at width 0; 'n/a' when unknown. Green to red as the ratio climbs, as in
    nvtop."""
    if ratio is None:
        return Text("n/a", style="dim")
    ratio = min(max(ratio, 0.0), 1.0)
    percent = f"{100 * ratio:3.0f}%"
    if width <= 0:
        return Text(percent)
    filled = round(ratio * width)
    style = "green" if ratio < 0.7 else "yellow" if ratio < 0.9 else "red"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"), f" {percent}")


def sparkline(values: Sequence[float | None], width: int = SPARK_WIDTH) -> Text:
    """The last ``width`` ratios (0..1) as block characters; a gap where a value is unknown."""
    chars = []
    for value in list(values)[-width:] if width > 0 else []:
        if value is None:
            chars.append(" ")
        else:
            chars.append(SPARK[min(int(min(max(value, 0.0), 1.0) * len(SPARK)), len(SPARK) - 1)])
    return Text("".join(chars), style="cyan")


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def _mhz(hertz: float | None) -> str:
    return "n/a" if hertz is None else f"{hertz / 1e6:.0f}"


def reason_label(reason: str) -> str:
    return REASON_LABELS.get(reason, reason)


@dataclass(frozen=True)
class _Layout:
    """How wide the elastic parts of a GPU row are drawn: the history first gives way, then the bars."""

    bar: int
    spark: int


def _gpu_row(gpu: GpuSample, history: list[float | None], layout: _Layout) -> list[Text]:
    if gpu.lost:
        cells = [Text(str(gpu.index)), Text("lost", style="bold red")] + [Text()] * 7
        cells[_EVENTS] = Text("NVML cannot reach this GPU", style="bold red")
        return cells
    busy = bar(gpu.utilization_ratio, layout.bar)
    if layout.spark:
        busy = Text.assemble(busy, " ", sparkline(history, layout.spark))
    memory = Text.assemble(
        bar(_ratio(gpu.memory_used_bytes, gpu.memory_total_bytes), layout.bar),
        f" {fmt_bytes(gpu.memory_used_bytes)}" if gpu.memory_used_bytes is not None else "",
    )
    power = "n/a" if gpu.power_watts is None else f"{gpu.power_watts:.0f}"
    if gpu.power_limit_watts is not None:
        power += f"/{gpu.power_limit_watts:.0f}"
    link = Text("n/a", style="dim")
    if gpu.pcie_link_generation is not None and gpu.pcie_link_width is not None:
        degraded = (gpu.pcie_link_width_max or 0) > gpu.pcie_link_width or (
            gpu.pcie_link_generation_max or 0
        ) > gpu.pcie_link_generation
        link = Text(f"gen{gpu.pcie_link_generation} x{gpu.pcie_link_width}", style="yellow" if degraded else "")
    reasons = [reason_label(r) for r in gpu.clock_event_reasons or [] if r not in QUIET_REASONS]
    return [
        Text(str(gpu.index)),
        busy,
        memory,
        Text(f"{_mhz(gpu.sm_clock_hertz)}/{_mhz(gpu.sm_clock_max_hertz)}"),
        Text(power),
        Text("n/a" if gpu.temperature_celsius is None else f"{gpu.temperature_celsius:.0f}"),
        link,
        Text(", ".join(reasons), style="bold red" if reasons else ""),
        Text(str(len(gpu.processes))),
    ]


def _table_width(rows: list[list[Text]], headers: list[str], wrap_events: bool) -> int:
    widths = []
    for column, header in enumerate(headers):
        cells = [row[column] for row in rows]
        if column == _EVENTS and wrap_events:  # wrapped at ", ": only its longest reason must fit on one line
            longest = max((len(part) for cell in cells for part in cell.plain.split(", ")), default=0)
        else:
            longest = max((cell.cell_len for cell in cells), default=0)
        widths.append(max(len(header), longest))
    return sum(widths) + COLUMN_GAP * (len(headers) - 1)


def gpu_table(samples: Sequence[Sample], width: int = 120) -> Table:
    """The GPU rows of the newest sample, laid out for ``width`` columns.

    Every column carries what some finding is about (clocks and their reasons for throttling, power for a cap,
    temperature, memory, the PCIe link, processes), so none is dropped or cut: the busy history shrinks
    first, then the bars, down to the bare numbers (which fit 80 columns)."""
    latest = samples[-1]
    histories = {
        gpu.index: [
            next((g.utilization_ratio for g in s.gpus if g.index == gpu.index), None) for s in samples[-SPARK_WIDTH:]
        ]
        for gpu in latest.gpus
    }

    def rows(layout: _Layout) -> list[list[Text]]:
        return [_gpu_row(gpu, histories[gpu.index], layout) for gpu in latest.gpus]

    headers = [name for name, _ in COLUMNS]
    layout = _Layout(bar=0, spark=0)
    # the reasons on one line before any bar, the bars before wrapping the reasons; the history takes what is left
    tries = [(bar_width, wrap) for wrap in (False, True) for bar_width in (BAR_WIDTH, BAR_WIDTH // 2, 0)]
    for bar_width, wrap in tries:
        spare = width - _table_width(rows(_Layout(bar_width, 0)), headers, wrap)
        if spare >= 0:
            # ... beside whole bars, when there is room for enough of it to show a trend
            spark = min(SPARK_WIDTH, spare - 1) if bar_width == BAR_WIDTH and spare > MIN_SPARK_WIDTH else 0
            layout = _Layout(bar_width, spark)
            break
    if layout.spark:
        headers[1] = "busy (recent)"
    table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    for (name, justify), header in zip(COLUMNS, headers, strict=True):
        # only the clock events may wrap (at ", "): the rest keep their width
        table.add_column(header, justify=justify, no_wrap=name != "clock events")  # type: ignore[arg-type]
    for gpu in latest.gpus:
        table.add_row(*_gpu_row(gpu, histories[gpu.index], layout))
    return table


@dataclass(frozen=True)
class GpuTable:
    """``gpu_table`` drawn at whatever width the console gives it (a live screen is resized under it)."""

    samples: Sequence[Sample]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield gpu_table(self.samples, options.max_width)


def host_line(host: HostSample | None) -> Values:
    """The host's figures as "key value" items, wrapped between items at the screen's width."""
    if host is None:
        return Values(["host: n/a"], style="dim")

    def rate(value: float | None) -> str:
        return "n/a" if value is None else f"{fmt_bytes(value)}/s"

    parts = [
        f"CPU {'n/a' if host.cpu_ratio is None else f'{100 * host.cpu_ratio:.0f}%'}"
        + (f" of {host.cpu_count}" if host.cpu_count else ""),
        f"iowait {'n/a' if host.cpu_iowait_ratio is None else f'{100 * host.cpu_iowait_ratio:.0f}%'}",
        f"mem {fmt_bytes(host.memory_used_bytes)}/{fmt_bytes(host.memory_total_bytes)}",
        f"swap {fmt_bytes(host.swap_used_bytes)}",
        f"disk r/w {rate(host.disk_read_bytes_per_second)} {rate(host.disk_write_bytes_per_second)}",
        f"net rx/tx {rate(host.network_rx_bytes_per_second)} {rate(host.network_tx_bytes_per_second)}",
    ]
    return Values([f"host: {parts[0]}", *parts[1:]])


def step_lines(latest_steps: dict[int, StepSample], watched: Sequence[str] = ()) -> list[Values]:
    """One line per rank; past ``MAX_RANK_LINES`` ranks, one line for all of them and one for the slowest rank.
    Before the first step, one line that says where the monitor looks for the step files (``watched``)."""
    if not latest_steps:
        if not watched:
            return []
        return [Values(["steps: none yet", *(f"watching {pattern}" for pattern in watched)], style="dim")]
    if len(latest_steps) > MAX_RANK_LINES:
        steps = list(latest_steps.values())
        times = sorted(s.time_s for s in steps)
        # in a synchronous job every rank's step takes as long as the slowest's: the rank to show is the one
        # whose own work (data, compute, optimizer) is longest
        slowest = max(steps, key=lambda s: s.data_s + s.compute_s + s.optimizer_s)
        median = times[len(times) // 2]
        return [
            Values(
                [
                    f"{len(steps)} ranks: step {min(s.step for s in steps)}-{max(s.step for s in steps)}",
                    f"median {fmt_duration(median)}/step ({fmt_duration(times[0])} to {fmt_duration(times[-1])})",
                ]
            ),
            *step_lines({slowest.rank: slowest}),
        ]
    lines = []
    for rank, step in sorted(latest_steps.items()):
        data = f"{100 * step.data_s / step.time_s:.0f}%" if step.time_s > 0 else "n/a"
        parts = [f"rank {rank}: step {step.step}", f"{fmt_duration(step.time_s)}/step", f"data {data}"]
        if step.samples_per_s is not None:
            parts.append(f"{fmt_count(step.samples_per_s)} samples/s")
        if step.mfu_catalog is not None:
            parts.append(f"MFU {100 * step.mfu_catalog:.1f}%")
        if step.loss is not None:
            parts.append(f"loss {step.loss:.4g}")
        lines.append(Values(parts))
    return lines


def finding_lines(findings: Sequence[Finding]) -> list[RenderableType]:
    """Each finding: its severity and title, then what to do on the lines below; a number stays with its unit."""
    if not findings:
        return [Text("no findings over the recent window", style="green")]
    lines: list[RenderableType] = []
    for f in findings:
        badge = Text(f" {f.severity.value.upper()} ", style=SEVERITY_STYLE[f.severity])
        lines.append(Values([badge, *prose(f.title)], separator=" ", indent=FINDING_INDENT))
        fix = Values([Text(word, style="dim") for word in prose(f.fix)], separator=" ", indent=0)
        lines.append(Padding(fix, (0, 0, 0, FINDING_INDENT), expand=False))
    return lines


def render(
    samples: Sequence[Sample],
    findings: Sequence[Finding],
    latest_steps: dict[int, StepSample],
    header: Sequence[str],
    notes: Sequence[str] = (),
    watched: Sequence[str] = (),
) -> Group:
    """The whole screen from the recent samples (oldest first), the active findings and each rank's newest step.
    ``header``: the items of the top line; ``watched``: the step files looked for, said until a step comes."""
    parts: list[RenderableType] = [Values(header, style="bold cyan")]
    if samples and samples[-1].gpus:
        parts.append(GpuTable(samples))
    else:
        parts.append(Text("no GPUs visible to NVML", style="dim"))
    parts.append(host_line(samples[-1].host if samples else None))
    parts.extend(step_lines(latest_steps, watched))
    parts.extend(finding_lines(findings))
    parts.extend(Values(["note:", *prose(note)], separator=" ", style="yellow") for note in notes)
    return Group(*parts)
