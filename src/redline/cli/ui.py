"""All terminal output goes through here: one stdout console for results, one stderr console for errors."""

from __future__ import annotations

import io
import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from redline.hw.snapshot import Gpu

if TYPE_CHECKING:
    from rich.progress import TaskID

    from redline.bench.model import Measurement
    from redline.transfer.engine import FileResult

# markup is off: hostnames, paths, /sys contents and user arguments are printed as they are, never parsed
# as rich markup ("[/]" in a path must not crash the error path). Styles go through Text.
console = Console(markup=False)
err_console = Console(stderr=True, markup=False)


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no colour, no wrapping, safe to pipe into jq."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(message: str) -> None:
    err_console.print(Text.assemble(("redline: ", "bold red"), message), highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    err_console.print(Text.assemble(("redline: ", "yellow"), message), highlight=False, soft_wrap=True)


def print_table(table: Table, *, out: Console | None = None) -> None:
    """Print ``table`` so that no cell is cut: as a table when it renders at the console's width with every
    word of every cell whole, else stacked, one block per row (its first cell, then ``header: value`` lines, as
    kubectl describe does). Rich's own answer to a narrow console is to cut a number to ``$17,4…`` or fold a name
    over five lines; a pipe, a job log or an SSH window is 80 columns, so every table a command prints goes
    through here."""
    out = out or console
    drawn = io.StringIO()
    Console(file=drawn, width=out.width, color_system=None, markup=False, emoji=False).print(table)
    out.print(table if _whole(table, drawn.getvalue()) else stacked(table))


def _whole(table: Table, drawn: str) -> bool:
    """Whether every word of every cell (and header) of ``table`` appears unbroken on a line of ``drawn``."""
    lines = drawn.splitlines()
    words = {
        word for column in table.columns for cell in (column.header, *column.cells) for word in _plain(cell).split()
    }
    return all(any(word in line for line in lines) for word in words)


def stacked(table: Table) -> Text:
    """``table`` as one block per row: the first cell as the row's heading, each other non-empty cell under it
    as ``header: value`` (a value longer than the line wraps under itself, at word boundaries)."""
    headers = [_plain(column.header) for column in table.columns]
    columns = [list(column.cells) for column in table.columns]
    width = max((len(h) for h in headers[1:]), default=0)
    lines = Text()
    if table.title:
        lines.append_text(Text.assemble(_styled(table.title), "\n"))
    for row in zip(*columns, strict=True):
        lines.append_text(Text.assemble(_styled(row[0]), "\n"))
        for header, cell in zip(headers[1:], row[1:], strict=True):
            if _plain(cell):
                label = f"  {header}:".ljust(width + 4) if header else "  "
                lines.append_text(Text.assemble(label, _styled(cell), "\n"))
    for caption in (table.caption,) if table.caption else ():
        lines.append_text(Text.assemble(_styled(caption), "\n"))
    lines.rstrip()
    return lines


def _styled(cell: RenderableType) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text(str(cell))


def _plain(cell: RenderableType) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def key_value_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, str(value))
    return table


def dim(message: str) -> Text:
    return Text(message, style="dim")


def gpu_line(gpu: Gpu) -> Text:
    """One line per GPU, like nvidia-smi -L with the numbers that matter for throughput."""
    if gpu.lost:
        return Text(f"GPU {gpu.index}: lost ({gpu.pci_bus_id})", style="red")
    parts = [
        f"GPU {gpu.index}: {gpu.name}",
        gpu.pci_bus_id or "",
        f"PCIe Gen{gpu.pcie.gen_current} x{gpu.pcie.width_current}",
        f"{gpu.power.draw_w or 0:.0f}/{gpu.power.enforced_limit_w or 0:.0f} W",
        f"{gpu.thermal.temperature_c} °C",
        f"SM {gpu.clocks.sm_mhz}/{gpu.clocks.sm_max_mhz} MHz",
    ]
    return Text("  ".join(p for p in parts if p))


@contextmanager
def progress_bar(enabled: bool = True, *, after_s: float = 2.0) -> Iterator[Callable[[str, int, int], None]]:
    """Say how long work is getting on, driven as ``progress(description, done, total)``, one description per
    unit of work (a suite, a trial, a backend). On a terminal, a rich progress bar per description, erased when the
    work ends. Off a terminal (a pipe, ``| tee``, a job log), phase's rule: one plain line per description that is
    still the current one after ``after_s``, ``redline: DESCRIPTION (done/total done) ...``, and nothing for one
    that a newer description replaces sooner; updates of the same description print nothing more, so a log gets
    one line per long unit of work, never a stream of redraws. Disabled (``--json``, ``--quiet``) it says nothing,
    so suites call it blindly; stdout is never written."""
    if not enabled:
        yield lambda description, done, total: None
        return
    if not err_console.is_terminal:
        lines = _ProgressLines(after_s)
        try:
            yield lines.update
        finally:
            lines.close()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tasks: dict[str, TaskID] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as progress:

        def update(description: str, completed: int, total: int) -> None:
            if description not in tasks:
                tasks[description] = progress.add_task(description, total=total)
            progress.update(tasks[description], completed=completed, total=total)

        yield update


class _ProgressLines:
    """progress_bar off a terminal: a line for the current description once it has been current ``after_s``,
    with the count as it stands then (a count of 0 or 1 in all says nothing and is left out)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.lock = threading.Lock()  # the timer's thread reads what update writes
        self.current: tuple[str, int, int] | None = None  # description, done, total
        self.timer: threading.Timer | None = None

    def update(self, description: str, done: int, total: int) -> None:
        with self.lock:
            new = self.current is None or self.current[0] != description
            self.current = (description, done, total)
        if new:
            self.close()
            self.timer = _say_later(self.after_s, lambda: self._line(description))

    def _line(self, description: str) -> Text | None:
        """The line for ``description``, None where a newer one replaced it as the timer fired."""
        with self.lock:
            if self.current is None or self.current[0] != description:
                return None
            _, done, total = self.current
        return _phase_line(f"{description} ({done}/{total} done)" if total > 1 else description)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _phase_line(description: str) -> Text:
    """How a long phase is said off a terminal: ``redline: DESCRIPTION ...``."""
    return Text.assemble(("redline: ", "dim"), description, " ...")


def _say_later(after_s: float, line: Callable[[], Text | None]) -> threading.Timer:
    """Print ``line()`` on stderr once ``after_s`` has passed (nothing where it returns None), unless the returned
    timer is cancelled first: what phase and progress_bar say off a terminal, only for work that lasts."""

    def say() -> None:
        text = line()
        if text is not None:
            err_console.print(text, highlight=False, soft_wrap=True)

    timer = threading.Timer(after_s, say)
    timer.daemon = True  # work that ends the process (an error, Ctrl-C) is not kept waiting on its line
    timer.start()
    return timer


@contextmanager
def phase(description: str, *, after_s: float = 2.0) -> Iterator[Callable[[int, int], None]]:
    """Say on stderr that work which may take a while is under way, so that a terminal is never left blank: on a
    terminal, a spinner with the description and the time spent (and ``done/total`` once the work reports a
    count through the yielded ``update(done, total)``), erased when the work ends; off a terminal (a pipe, a job
    log), one plain line, ``redline: DESCRIPTION ...``, once the work has run ``after_s``, and nothing for work
    that ends sooner (a log gets one line per long phase, never a stream of redraws). stdout is never written,
    so ``--json`` output stays clean."""
    if not err_console.is_terminal:
        timer = _say_later(after_s, lambda: _phase_line(description))
        try:
            yield lambda done, total: None
        finally:
            timer.cancel()
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=None, count="")

        def update(done: int, total: int) -> None:
            progress.update(task, count=f"{done}/{total}")

        yield update


def print_measurements(measurements: list[Measurement]) -> None:
    """Bench results: value, the peak it is compared with, how far repeats scattered; how each was
    measured follows the table as numbered notes, so the table stays readable on an 80-column terminal. A
    figure measured while other processes kept the CPUs busy is marked ``*`` and footnoted. A figure that is
    one setting of a grid the suite tried (``extra["setting"]``, e.g. the dataloader's "num_workers=0") is
    named by that setting, so the row says what gave the figure; the grid follows the table."""
    table = Table(title="redline bench", title_justify="left", box=None, pad_edge=False)
    # a column of "n/a" says nothing (a CPU has no catalog peak; each note says so): left out, to fit 80 columns
    peaks = any(m.ratio is not None and m.peak for m in measurements)
    for column in ("suite", "measurement"):
        table.add_column(column, justify="left", no_wrap=True)
    for column in ("value", "of peak", "p10-p90", "how") if peaks else ("value", "p10-p90", "how"):
        table.add_column(column, justify="right", no_wrap=True)
    methods: list[str] = []
    busy: dict[str, list[str]] = {}  # what kept the host busy -> the suites measured meanwhile
    for m in measurements:
        method = m.method + (f" Peak: {m.peak_source}." if m.peak_source else "")
        if method not in methods:
            methods.append(method)
        if m.busy_host:
            suites = busy.setdefault(str(m.extra["host_cpu"].get("summary")), [])
            if m.suite not in suites:
                suites.append(m.suite)
        peak = Text(f"{m.ratio:.0%} of {_figure(m.peak, 4)}" if m.ratio is not None and m.peak else "n/a")
        table.add_row(
            Text(m.suite),
            Text(str(m.extra.get("setting") or m.name) + (f" {m.device}" if m.device != "cpu" else "")),
            Text(f"{_figure(m.value, 4)} {m.unit}" + ("*" if m.busy_host else "")),
            *([peak] if peaks else []),
            Text(f"{_figure(m.spread.p10, 3)}-{_figure(m.spread.p90, 3)}" if m.spread else ""),
            Text(f"[{methods.index(method) + 1}]", style="dim"),
        )
    print_table(table)
    for i, method in enumerate(methods, 1):
        console.print(Text(f"[{i}] {method}", style="dim"))
    for summary, suites in busy.items():
        console.print(
            Text(
                f"* {', '.join(suites)}: measured while {summary}; such figures understate this machine "
                "(`redline doctor` names what is busy)",
                style="yellow",
            )
        )
    for m in measurements:
        if m.extra.get("grid"):
            print_table(_grid_table(m))
    for m in measurements:  # what a reader must know about a figure: an emulated precision, advice
        for note in m.extra.get("notes", []):
            console.print(Text(f"{m.suite} {m.name}: {note}", style="yellow"))


def _grid_table(m: Measurement) -> Table:
    """Every setting a suite tried (``extra["grid"]``: flat rows), the recommended one (``extra["recommended"]``,
    the settings that pick it out) marked. A pair of keys ``X_p10`` and ``X_p90`` is one column, "p10-p90"."""
    rows: list[dict[str, Any]] = m.extra["grid"]
    chosen = m.extra.get("recommended") or {}
    table = Table(title=f"{m.suite}: every setting tried", title_justify="left", box=None, pad_edge=False)
    columns = [c for c in rows[0] if not c.endswith("_p90") and GRID_LABELS.get(c, c) is not None]
    for column in columns:
        label = "p10-p90" if column.endswith("_p10") else GRID_LABELS.get(column, column)
        table.add_column(label or column, justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)

    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        return _figure(value, 4) if isinstance(value, float) else _cell(value)

    for row in rows:
        picked = bool(chosen) and all(row.get(k) == v for k, v in chosen.items())
        cells = [
            f"{cell(row.get(c))}-{cell(row.get(c[:-4] + '_p90'))}" if c.endswith("_p10") else cell(row.get(c))
            for c in columns
        ]
        table.add_row(*cells, Text("<- use" if picked else "", style="bold green"))
    return table


def _figure(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, in plain figures up to ten million ("123,500" and "1,100",
    not "1.235e+05" and "1.1e+03"), with an exponent only beyond."""
    if 1e3 <= abs(value) < 1e7:
        return f"{float(f'{value:.{digits}g}'):,.0f}"
    return f"{value:.{digits}g}"


# short headers for the keys of a suite's grid rows (the JSON keeps the full names, e.g. DataLoader's kwargs);
# None: a key the table leaves out (persistent_workers is on exactly when there are workers)
GRID_LABELS: dict[str, str | None] = {
    "num_workers": "workers",
    "prefetch_factor": "prefetch",
    "persistent_workers": None,
    "pin_memory": "pin",
    "threads": "threads",
    "samples_per_s": "samples/s",
    "startup_s": "start-up s",
}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@contextmanager
def transfer_progress(enabled: bool = True) -> Iterator[Any]:
    """A byte progress bar for fetch and push: done/total, rate, ETA, streams in flight. Disabled (--json,
    stderr not a terminal) it draws nothing. Yields an engine ``Progress``."""
    from redline.transfer.engine import Progress as Quiet

    class _Told(Quiet):  # no bar, but a wait on another process is still said
        def note(self, message: str) -> None:
            err_console.print(message, markup=False, highlight=False, soft_wrap=True)

    if not enabled or not err_console.is_terminal:
        yield _Told()
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[streams]} streams, {task.fields[files]} files done"),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("moving", total=0, streams=0, files=0)

        class _Drawn(_Told):  # err_console is the bar's: a note prints above it
            def add_total(self, size: int) -> None:
                bar.update(task, total=(bar.tasks[0].total or 0) + size)

            def advance(self, size: int) -> None:
                bar.advance(task, size)

            def active(self, streams: int) -> None:
                bar.update(task, streams=streams)

            def finished(self, result: FileResult) -> None:
                bar.update(task, files=bar.tasks[0].fields["files"] + 1)

        yield _Drawn()
