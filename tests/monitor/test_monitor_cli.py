"""`redline monitor` and `redline report` as a user runs them: real processes, this machine's host (no GPU here),
records made from the fake-NVML traces for the GPU side, and every bad input one line with a non-zero exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli
from fakes.traces import scenario
from redline.monitor.store import Store
from redline.units import fmt_bytes
from tables import WIDTHS, assert_whole


def record_of(name: str, tmp_path: Path, ticks: int = 40) -> Path:
    """A record of one trace scenario, written as `redline monitor --record` writes it."""
    path = tmp_path / f"{name}.rlm"
    with Store.open(path) as store:
        for sample in scenario(name, root=tmp_path / name, ticks=ticks).run():
            store.append(sample)
    return path


def test_once_json_reports_the_host_and_says_why_there_are_no_gpus() -> None:
    result = run_cli("monitor", "--once", "--json", "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    host = out["sample"]["host"]
    assert host["cpu_count"] == os.cpu_count() and 0 <= host["cpu_ratio"] <= 1
    assert host["memory_total_bytes"] > 0 and host["disk_read_bytes_per_second"] is not None  # a rate: 2 readings
    if not out["sample"]["gpus"]:
        assert sum("no GPU telemetry" in note for note in out["sample"]["notes"]) == 1  # once, not per reading
    assert out["findings"] == []


def test_record_then_report(tmp_path: Path) -> None:
    record = tmp_path / "run.rlm"
    result = run_cli("monitor", "--record", str(record), "--interval", "0.2", "--duration", "1.5", "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) >= 4 and all(line["host"] for line in lines)
    assert f"recorded {len(lines)} samples to {record}" in result.stderr

    report = run_cli("report", str(record), "--json")
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert summary["samples"] == len(lines)
    assert summary["start"] == pytest.approx(lines[0]["time"]) and summary["end"] == pytest.approx(lines[-1]["time"])


def test_a_terminal_user_gets_a_line_per_sample_in_a_pipe() -> None:
    result = run_cli("monitor", "--interval", "0.2", "--duration", "0.7")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 3 <= len(lines) <= 5 and all("cpu " in line for line in lines)


def _recording(record: Path, interval: str) -> subprocess.Popen[str]:
    """`redline monitor --record RECORD --json` in the background: a line on stdout per committed sample."""
    return subprocess.Popen(
        [sys.executable, "-m", "redline", "monitor", "--record", str(record), "--interval", interval, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_closes_the_record_with_every_sample(tmp_path: Path) -> None:
    record = tmp_path / "run.rlm"
    proc = _recording(record, interval="0.1")
    try:
        assert proc.stdout is not None
        for _ in range(5):  # five samples printed, so five committed
            assert proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    printed = 5 + len(out.splitlines())
    with Store.read(record) as store:
        assert store.count() == printed


@contextlib.contextmanager
def monitor_serving() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`redline monitor --port PORT` (a free port) once it has taken a sample, and so serves: (it, PORT);
    stopped with SIGTERM after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "redline", "monitor", "--port", str(port), "--interval", "0.2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline()  # one sample taken
        yield proc, port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
        proc.kill()


def test_the_metrics_endpoint_serves_while_monitoring() -> None:
    with monitor_serving() as (_, port):
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "redline_host_memory_total_bytes" in body and "redline_monitor_up 1.0" in body


@pytest.mark.slow
def test_report_diagnoses_a_recorded_trace_and_writes_html_and_pngs(tmp_path: Path) -> None:
    record = record_of("throttling", tmp_path)
    html, pngs = tmp_path / "report.html", tmp_path / "plots"
    result = run_cli("report", str(record), "--html", str(html), "--png", str(pngs), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["samples"] == 40 and len(summary["gpus"]) == 8
    rules = {(f["rule"], f["subject"]) for f in summary["findings"]}
    assert ("monitor.thermal", "GPUs 2,5") in rules
    assert "first_seen" in summary["findings"][0]["evidence"]
    page = html.read_text()
    assert "data:image/png;base64," in page and "throttled" in page
    assert sorted(p.suffix for p in pngs.iterdir()) and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs.iterdir())

    text = run_cli("report", str(record))
    assert text.returncode == 0 and "40 samples" in text.stdout and "GPUs 2,5" in text.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_report_at_a_terminal_width_keeps_every_value_whole(tmp_path: Path, width: int) -> None:
    record = record_of("throttling", tmp_path)
    result = run_cli("report", str(record), columns=width)
    assert result.returncode == 0, result.stderr
    with Store.read(record) as store:
        gpus = list(store.gpu_stats().values())
    assert_whole(result.stdout, "40 samples", "over 39.0 s", "1980 → 1544 MHz", "40.0 s", "90 °C", width=width)
    lines = [line.split() for line in result.stdout.splitlines()]
    for g in gpus:  # each GPU's row whole, a cell per column
        memory, power, energy = fmt_bytes(g.memory_peak_bytes), g.power_mean_watts, g.energy_joules / 3.6e6
        cells = f"{g.gpu} {100 * g.utilization_mean_ratio:.0f}% {100 * g.utilization_p95_ratio:.0f}% {memory}"
        cells += f" {power:.0f} {energy:.3g} {g.temperature_max_celsius:.0f}"
        assert cells.split() in lines, (cells, result.stdout)
    assert_whole(result.stdout, "mean W", "energy kWh", "rank  steps  mean step  waiting for data")


def test_a_healthy_trace_reports_no_findings(tmp_path: Path) -> None:
    result = run_cli("report", str(record_of("healthy", tmp_path)), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["findings"] == []


# ------------------------------------------------------------------------------------------- bad input


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_options_are_one_line() -> None:
    _one_line_error(run_cli("monitor", "--interval", "0"), "--interval")
    _one_line_error(run_cli("monitor", "--retention", "7d"), "--record")
    _one_line_error(run_cli("monitor", "--window", "soon", "--once"), "--window")
    _one_line_error(run_cli("monitor", "--window", "1e30", "--once"), "--window")
    _one_line_error(run_cli("monitor", "--gpus", "a,b", "--once"), "--gpus")
    _one_line_error(run_cli("monitor", "--port", "70000", "--once"), "--port")


def test_a_port_in_use_is_one_line_and_nothing_is_recorded(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _one_line_error(run_cli("monitor", "--port", str(port), "--once"), f"port {port}", "in use")


def test_a_record_that_is_not_ours_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    _one_line_error(run_cli("monitor", "--record", str(notes), "--once"), str(notes))
    _one_line_error(run_cli("report", str(notes)), str(notes))
    assert notes.read_text() == "my notes\n"
    _one_line_error(run_cli("report", str(tmp_path / "missing.rlm")), "missing.rlm")


def test_an_unwritable_record_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    _one_line_error(run_cli("monitor", "--record", str(blocker / "run.rlm"), "--once"), "run.rlm")


def test_a_truncated_record_is_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    record = record_of("healthy", tmp_path, ticks=12)
    cut = record.read_bytes()[: record.stat().st_size // 2]  # a copy cut short in transfer
    record.write_bytes(cut)
    _one_line_error(run_cli("report", str(record)), str(record))
    _one_line_error(run_cli("monitor", "--record", str(record), "--once"), str(record))
    assert record.read_bytes() == cut


def test_report_of_an_empty_record_is_one_line(tmp_path: Path) -> None:
    record = tmp_path / "empty.rlm"
    Store.open(record).close()
    _one_line_error(run_cli("report", str(record)), "no samples")


def test_a_second_monitor_on_one_record_is_refused_and_the_first_keeps_it(tmp_path: Path) -> None:
    record = tmp_path / "two.rlm"
    first = _recording(record, interval="0.2")
    try:
        assert first.stdout is not None and first.stdout.readline()  # recording
        _one_line_error(
            run_cli("monitor", "--record", str(record), "--interval", "0.2", "--duration", "1"),
            str(record),
            f"pid {first.pid}",
        )
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err
    with Store.read(record) as store:
        assert store.count() == 1 + len(out.splitlines())  # the first monitor's samples, and only those


def test_report_leaves_the_record_and_its_wal_as_they_were(tmp_path: Path) -> None:
    record = tmp_path / "run.rlm"
    proc = subprocess.Popen(
        [sys.executable, "-m", "redline", "monitor", "--record", str(record), "--interval", "0.1", "--json"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for _ in range(5):
        assert proc.stdout.readline()
    proc.kill()  # SIGKILL: its commits stay in the WAL
    proc.communicate(timeout=120)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "run.rlm-shm"}
    result = run_cli("report", str(record), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["samples"] >= 5
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "run.rlm-shm"} == before


def test_a_window_shorter_than_the_rules_need_is_said_once(tmp_path: Path) -> None:
    record = record_of("throttling", tmp_path)  # one sample a second: the rules need 10 of them
    short = run_cli("report", str(record), "--window", "5s", "--json")
    assert short.returncode == 0, short.stderr
    assert json.loads(short.stdout)["findings"] == []
    assert short.stderr.count("--window 5s is shorter than the diagnosis needs") == 1
    assert "--window 10s or more" in short.stderr
    enough = run_cli("report", str(record), "--window", "10s", "--json")
    assert json.loads(enough.stdout)["findings"] and "shorter" not in enough.stderr

    live = run_cli("monitor", "--interval", "2", "--window", "12s", "--duration", "0.5")
    assert live.returncode == 0 and "--window 20s or more" in live.stderr  # 10 samples at 2 s: 20 s


def test_listen_takes_addresses_and_all_only() -> None:
    for value in ("0", "*", "", "metrics.example"):
        _one_line_error(run_cli("monitor", "--port", "9400", "--listen", value, "--once"), "--listen takes")
