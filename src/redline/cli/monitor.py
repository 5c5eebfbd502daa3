"""`redline monitor`: watch the GPUs, the host and the training steps; record, export, diagnose.
`redline report`: the page (or PNGs) of a record, with the diagnosis over it."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from redline.cli import params, ui
from redline.errors import BadInput, RedlineError
from redline.units import fmt_duration, parse_duration

MAX_WINDOW_SAMPLES = 100_000  # the diagnosis keeps its window in memory: a day at 1 s is enough
DIAGNOSE_EVERY_S = 5.0  # the rules judge a window: re-judging it every sample would only repeat them


def _duration(option: str, text: str) -> float:
    try:
        return parse_duration(text)  # a bare number is seconds
    except ValueError as exc:
        raise BadInput(f"{option} {exc}") from None


def _indices(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadInput(f"--gpus '{text}' is not a list of GPU indices like 0,1,2") from None
    if not indices or min(indices) < 0:
        raise BadInput(f"--gpus '{text}' is not a list of GPU indices like 0,1,2")
    return indices


def monitor(
    interval: float = typer.Option(1.0, "--interval", help="Seconds between samples."),
    record: Path | None = typer.Option(
        None, "--record", help="Record every sample into this file (SQLite; appends to a record redline wrote)."
    ),
    retention: str | None = typer.Option(None, "--retention", help="With --record: keep this much (12h, 7d)."),
    port: int | None = typer.Option(None, "--port", help="Serve Prometheus metrics on this port (127.0.0.1)."),
    listen: str | None = typer.Option(
        None, "--listen", help=f"Serve the metrics on this address instead of 127.0.0.1: {params.LISTEN_HELP}."
    ),
    steps: list[str] = typer.Option(
        [],
        "--steps",
        help="The training run's metrics JSON lines (a path or glob, '{rank}' allowed); repeatable; files that "
        "appear later are followed too. Default: redline-steps/rank-{rank}.jsonl, where the examples write.",
    ),
    gpus: str | None = typer.Option(None, "--gpus", help="GPU indices to watch, e.g. 0,1 (default: all)."),
    job_pids: list[int] = typer.Option([], "--job-pid", help="A process of the job; others are 'foreign'."),
    window: str = typer.Option("60s", "--window", help="How much recent history the diagnosis judges."),
    duration: str | None = typer.Option(None, "--duration", help="Stop after this long (default: Ctrl-C)."),
    once: bool = typer.Option(False, "--once", help="Sample once (twice, an interval apart, for rates) and exit."),
    json_out: bool = typer.Option(False, "--json", help="JSON: with --once one object, else one line per sample."),
) -> None:
    """Live GPU, host and training telemetry with diagnosis; optionally recorded and exported to Prometheus."""
    if not 0.05 <= interval <= 3600:
        raise BadInput(f"--interval {interval} is out of range: give seconds between 0.05 and 3600")
    if retention is not None and record is None:
        raise BadInput("--retention applies to a record: add --record FILE")
    retention_s = _duration("--retention", retention) if retention is not None else None
    window_s = _duration("--window", window)
    if window_s / interval > MAX_WINDOW_SAMPLES:
        raise BadInput(f"--window {window} holds more than {MAX_WINDOW_SAMPLES:,} samples: shorten it")
    if not once:
        _warn_short_window(window, window_s, interval)
    stop_after_s = _duration("--duration", duration) if duration is not None else None
    if port is not None:
        params.tcp_port("--port", port)
    if listen is not None:
        listen = params.listen_address("--listen", listen)

    from redline.monitor.sampler import Sampler
    from redline.monitor.steps import step_patterns, watch_note

    _check_step_files(steps)
    _check_pids(job_pids)
    steps = step_patterns(steps)

    with contextlib.ExitStack() as stack:
        store = _open_record(record, retention_s, stack)
        sampler = Sampler(indices=_indices(gpus), step_paths=steps)
        stack.callback(sampler.close)
        exporter = _serve(sampler, port, listen, interval, stack)
        ui.warn(watch_note(steps))  # once every option is taken: a refused one stays the only line
        session = _Session(sampler, store, exporter, window_s, interval, set(job_pids) or None)
        if once:
            session.once(json_out)
        else:
            session.run(json_out, stop_after_s)
    if record is not None and session.recorded:
        ui.warn(f"recorded {session.recorded} samples to {record}")


def _check_pids(pids: list[int]) -> None:
    """A --job-pid this kernel could never have given out: refused, rather than watched for in vain."""
    from redline.hw.limits import pid_cap

    cap = pid_cap()
    for pid in pids:
        if pid < 1 or (cap is not None and pid > cap.most):
            most = f"{cap.most} ({cap.why})" if cap is not None else "the kernel's pid_max"
            raise BadInput(f"--job-pid {pid} is not a process id on this host: they run from 1 to {most}")


def _check_step_files(patterns: list[str]) -> None:
    """A --steps path named outright (no glob, no ``{rank}``) that is a FIFO, a device or a folder: refused."""
    import glob

    from redline.files import refuse_non_regular

    for pattern in patterns:
        if not glob.has_magic(pattern) and "{rank}" not in pattern:
            refuse_non_regular(pattern, "--steps")


def _warn_short_window(option: str, window_s: float, interval_s: float) -> None:
    """A window shorter than the rules need is allowed (the screen still works) but never yields a finding."""
    from redline.monitor.diagnose import shortest_window_s

    shortest = shortest_window_s(interval_s)
    if window_s < shortest:
        ui.warn(
            f"--window {option} is shorter than the diagnosis needs at one sample every {interval_s:.3g} s "
            f"({shortest:.3g} s): it will report no finding; give --window {math.ceil(shortest):d}s or more"
        )


def _open_record(record: Path | None, retention_s: float | None, stack: contextlib.ExitStack) -> Any:
    if record is None:
        return None
    from redline.monitor.store import Store

    store = Store.open(record, retention_s=retention_s)
    stack.callback(store.close)
    return store


def _serve(sampler: Any, port: int | None, listen: str | None, interval: float, stack: contextlib.ExitStack) -> Any:
    if port is None and listen is None:
        return None
    from redline.monitor.exporter import DEFAULT_HOST, DEFAULT_PORT, Exporter, serve

    exporter = Exporter(driver_version=sampler.driver_version, stale_after_s=max(3 * interval, 10.0))
    server = serve(exporter, host=listen or DEFAULT_HOST, port=DEFAULT_PORT if port is None else port)
    stack.callback(server.shutdown)
    ui.warn(f"serving Prometheus metrics at {server.url}")
    return exporter


class _Session:
    """One monitoring session: each sample goes to the record, the exporter, the diagnosis and the screen."""

    def __init__(
        self, sampler: Any, store: Any, exporter: Any, window_s: float, interval: float, job_pids: set[int] | None
    ) -> None:
        self.sampler = sampler
        self.store = store
        self.exporter = exporter
        self.interval = interval
        self.job_pids = job_pids
        self.recent: collections.deque = collections.deque(maxlen=max(2, round(window_s / interval)))
        self.latest_steps: dict[int, Any] = {}
        self.findings: list[Any] = []
        self.notes: collections.deque[str] = collections.deque(maxlen=5)
        self.recorded = 0
        self._diagnosed_at: float | None = None

    # ------------------------------------------------------------------------------------- one sample

    def take(self, sample: Any) -> None:
        self.recent.append(sample)
        for step in sample.steps:
            self.latest_steps[step.rank] = step
        self.notes.extend(sample.notes)
        if self.store is not None:
            self._record(sample)
        if self.exporter is not None:
            self.exporter.update(sample)
        now = time.monotonic()
        if self._diagnosed_at is None or now - self._diagnosed_at >= DIAGNOSE_EVERY_S:
            from redline.monitor.diagnose import diagnose

            self.findings = diagnose(list(self.recent), job_pids=self.job_pids)
            self._diagnosed_at = now

    def _record(self, sample: Any) -> None:
        """Append; when the record stops taking samples (disk full, file removed), say so once and go on
        monitoring: what was recorded stays committed."""
        try:
            self.store.append(sample)
            self.recorded += 1
        except (RedlineError, OSError) as exc:
            ui.warn(f"recording stopped after {self.recorded} samples: {exc}; monitoring goes on")
            with contextlib.suppress(Exception):
                self.store.close()
            self.store = None

    # ---------------------------------------------------------------------------------------- output

    def once(self, json_out: bool) -> None:
        first = self.sampler.sample()
        self.take(first)
        time.sleep(min(self.interval, 1.0))  # a second reading, so counters become rates
        sample = self.sampler.sample()
        self.take(sample)
        if json_out:
            # a note comes once, with the sample that first saw it: this one answers for both readings
            out = sample.to_dict() | {"notes": first.notes + sample.notes}
            ui.print_json({"sample": out, "findings": [f.to_dict() for f in self.findings]})
        else:
            ui.console.print(self._screen())

    def run(self, json_out: bool, stop_after_s: float | None) -> None:
        from redline.monitor.sampler import run_sampler

        stop = threading.Event()
        live = None
        if not json_out and ui.console.is_terminal:
            from rich.live import Live

            live = Live(console=ui.console, auto_refresh=False, screen=False, transient=False)

        def on_sample(sample: Any) -> None:
            self.take(sample)
            if live is not None:
                live.update(self._screen(), refresh=True)
            elif json_out:
                sys.stdout.write(json.dumps(sample.to_dict(), separators=(",", ":")) + "\n")
                sys.stdout.flush()
            else:
                ui.console.print(_sample_line(sample, self.findings))

        timer = threading.Timer(stop_after_s, stop.set) if stop_after_s is not None else None
        with _stop_on_sigterm(stop), live or contextlib.nullcontext():
            if timer is not None:
                timer.daemon = True
                timer.start()
            try:
                run_sampler(self.sampler, self.interval, on_sample, stop)
            except KeyboardInterrupt:
                pass  # Ctrl-C is how a monitor is stopped
            finally:
                if timer is not None:
                    timer.cancel()

    def _screen(self) -> Any:
        from redline.monitor.dashboard import render

        header = ["redline monitor", f"every {self.interval:g} s"]
        if self.store is not None:
            header.append(f"recording to {self.store.name} ({self.recorded} samples)")
        watched = self.sampler.steps.patterns
        return render(list(self.recent), self.findings, self.latest_steps, header, list(self.notes), watched)


@contextlib.contextmanager
def _stop_on_sigterm(stop: threading.Event) -> Iterator[None]:
    """SIGTERM (systemd, kill, a container stop) ends the session like Ctrl-C: the record is closed cleanly."""
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sample_line(sample: Any, findings: list[Any]) -> Any:
    """For a log file or a pipe: time, each GPU's utilisation/memory/power, the host CPU, each rank's newest step
    since the last sample, the findings; one line where they fit the console's width, else wrapped between GPUs
    and ranks onto indented lines (a reader, and grep, finds each GPU's and each rank's figures whole)."""
    from redline.report.wrap import Values

    stamp = time.strftime("%H:%M:%S", time.localtime(sample.time))
    parts = [stamp]
    for gpu in sample.gpus:
        if gpu.lost:
            parts.append(f"gpu{gpu.index} lost")
            continue
        util = "n/a" if gpu.utilization_ratio is None else f"{100 * gpu.utilization_ratio:.0f}%"
        memory = "n/a" if gpu.memory_used_bytes is None else f"{gpu.memory_used_bytes / 2**30:.1f}GiB"
        power = "n/a" if gpu.power_watts is None else f"{gpu.power_watts:.0f}W"
        parts.append(f"gpu{gpu.index} {util} {memory} {power}")
    cpu = None if sample.host is None else sample.host.cpu_ratio
    parts.append("cpu n/a" if cpu is None else f"cpu {100 * cpu:.0f}%")
    newest = {step.rank: step for step in sample.steps}  # the steps finished since the last sample, in order
    for rank, step in sorted(newest.items()):
        loss = "" if step.loss is None else f" loss {step.loss:.4g}"
        parts.append(f"rank{rank} step {step.step} {fmt_duration(step.time_s)}/step{loss}")
    named = [f"{f.severity.value} {f.rule}" for f in findings]
    if named:
        parts += [f"findings: {named[0]}", *named[1:]]
    return Values(parts)


# ------------------------------------------------------------------------------------------------ report


def report(
    record: Path = typer.Argument(..., help="A record written by `redline monitor --record`."),
    html: Path | None = typer.Option(None, "--html", help="Write a self-contained HTML page to this file."),
    png: Path | None = typer.Option(None, "--png", help="Write each plot as a PNG into this folder."),
    window: str = typer.Option("5m", "--window", help="The diagnosis judges the record in windows this long."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary and findings as JSON."),
) -> None:
    """Summarise a monitor record: per-GPU and per-rank figures, the findings over time, plots."""
    from redline.monitor.store import Store

    window_s = _duration("--window", window)
    if png is not None:
        from redline.files import refuse_non_folder

        refuse_non_folder(png, "--png")
    with contextlib.closing(Store.read(record)) as store:
        span = store.time_range()
        if span is None:
            raise BadInput(f"{record} holds no samples yet")
        count = store.count()
        if count > 1:
            _warn_short_window(window, window_s, (span[1] - span[0]) / (count - 1))
        findings = diagnose_record(store, window_s)
        if html is not None:
            from redline.monitor.report import render_html

            render_html(store, findings, html, title=f"redline monitor report: {record.name}")
            ui.warn(f"wrote {html}")
        if png is not None:
            from redline.monitor.report import render_pngs

            for path in render_pngs(store, png):
                ui.warn(f"wrote {path}")
        gpu_stats, step_stats = store.gpu_stats(), store.step_stats()
    summary = {
        "record": str(record),
        "start": span[0],
        "end": span[1],
        "samples": count,
        "gpus": [vars(s) for s in gpu_stats.values()],
        "ranks": [vars(s) for s in step_stats.values()],
        "findings": [f.to_dict() for f in findings],
    }
    if json_out:
        ui.print_json(summary)
    else:
        _print_report(summary, findings)


def diagnose_record(store: Any, window_s: float) -> list[Any]:
    """The diagnosis over a whole record, window by window (a rule judges minutes, not days); a finding seen in
    several windows is kept once, from the window where it was worst, with when it was first and last seen."""
    from dataclasses import replace

    from redline.monitor.diagnose import diagnose

    seen: dict[tuple[str, str | None], Any] = {}
    first_seen: dict[tuple[str, str | None], float] = {}
    last_seen: dict[tuple[str, str | None], float] = {}
    for window in _windows(store, window_s):
        for finding in diagnose(window):
            key = (finding.rule, finding.subject)
            first_seen.setdefault(key, window[0].time)
            last_seen[key] = window[-1].time
            if key not in seen or finding.severity.rank < seen[key].severity.rank:
                seen[key] = finding
    return [
        replace(f, evidence=f.evidence | {"first_seen": first_seen[key], "last_seen": last_seen[key]})
        for key, f in seen.items()
    ]


def _windows(store: Any, window_s: float) -> Iterator[list[Any]]:
    window: list[Any] = []
    for sample in store.samples():
        if window and sample.time - window[0].time >= window_s:
            yield window
            window = []
        window.append(sample)
    if window:
        yield window


def _print_report(summary: dict[str, Any], findings: list[Any]) -> None:
    """The record's span, a table of its GPUs and one of its ranks, then the findings; whole at 80 columns."""
    from redline.report.terminal import render_finding
    from redline.report.wrap import Values
    from redline.units import fmt_duration

    start, end = summary["start"], summary["end"]
    span = [
        f"{summary['record']}:",
        f"{summary['samples']} samples",
        f"over {fmt_duration(end - start)}",
        f"from {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(start))}",
    ]
    ui.console.print(Values(span, separator=" "))
    if summary["gpus"]:
        ui.print_table(_gpu_table(summary["gpus"]))
    if summary["ranks"]:
        ui.print_table(_rank_table(summary["ranks"]))
    for finding in sorted(findings, key=lambda f: f.severity.rank):
        ui.console.print(render_finding(finding))
    if not findings:
        ui.console.print("no findings over this record")


def _gpu_table(gpus: list[dict[str, Any]]) -> Any:
    """Per GPU: how busy (mean and 95th percentile), memory and power; the units in the headers."""
    from rich.table import Table

    from redline.units import fmt_bytes

    table = Table(box=None, header_style="bold")
    for column in ("GPU", "busy mean", "busy p95", "peak memory", "mean W", "energy kWh", "max °C"):
        table.add_column(column, justify="right", no_wrap=True)
    for gpu in gpus:
        table.add_row(
            str(gpu["gpu"]),
            _percent(gpu["utilization_mean_ratio"]),
            _percent(gpu["utilization_p95_ratio"]),
            fmt_bytes(gpu["memory_peak_bytes"]),
            "n/a" if gpu["power_mean_watts"] is None else f"{gpu['power_mean_watts']:.0f}",
            "n/a" if gpu["energy_joules"] is None else f"{gpu['energy_joules'] / 3.6e6:.3g}",
            "n/a" if gpu["temperature_max_celsius"] is None else f"{gpu['temperature_max_celsius']:.0f}",
        )
    return table


def _rank_table(ranks: list[dict[str, Any]]) -> Any:
    """Per training rank: its steps, their mean time and the share of it spent waiting for data."""
    from rich.table import Table

    from redline.units import fmt_duration

    table = Table(box=None, header_style="bold")
    for column in ("rank", "steps", "mean step", "waiting for data"):
        table.add_column(column, justify="right", no_wrap=True)
    for rank in ranks:
        table.add_row(
            str(rank["rank"]), str(rank["steps"]), fmt_duration(rank["time_mean_s"]), _percent(rank["data_share_ratio"])
        )
    return table


def _percent(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{100 * ratio:.0f}%"
