"""The `redline` command end to end, as a separate process: exit codes, JSON, HTML, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES, run_cli, run_executable
from redline.hw.snapshot import SCHEMA_VERSION, load_snapshot

FAULTY = str(FIXTURES / "h100x8-faulty.json")
SHARED = str(FIXTURES / "rtx4090x4-shared.json")


def assert_one_line_error(proc, code: int, *needles: str) -> None:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_probe_json_is_a_loadable_snapshot_of_this_host(tmp_path):
    proc = run_executable("probe", "--json", "--data", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["host"]["memory_total_bytes"] > 0
    assert data["host"]["cpu_logical_cores"] >= 1
    assert any(i["name"] == "lo" for i in data["network"]["interfaces"])
    assert data["storage"]["data_paths"][0]["exists"] is True
    snap = tmp_path / "snap.json"
    snap.write_text(proc.stdout)
    assert load_snapshot(snap).host.memory_total_bytes == data["host"]["memory_total_bytes"]


def test_probe_writes_output_file(tmp_path):
    out = tmp_path / "snap.json"
    proc = run_cli("probe", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "redline probe" in proc.stdout
    assert json.loads(out.read_text())["schema_version"] == SCHEMA_VERSION


def test_doctor_audits_this_host():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "redline doctor" in proc.stdout
    assert "rules" in proc.stdout


def test_doctor_from_faulty_8_gpu_snapshot_finds_the_faults():
    proc = run_cli("doctor", "--from", FAULTY, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    found = {(f["rule"], f["severity"]) for f in report["findings"]}
    expected = {
        ("hardware.pcie-link-degraded", "fail"),
        ("power_thermal.power-capped", "warn"),
        ("power_thermal.throttled", "fail"),
        ("gpu_memory.ecc-errors", "fail"),
        ("gpu_memory.row-remap", "fail"),
        ("multi_gpu.p2p-unavailable", "fail"),
        ("network.ib-disabled", "fail"),
        ("host.shm-small", "fail"),
        ("host.cpu-governor", "warn"),
        ("host.cgroup-cpu", "warn"),
        ("distributed.memlock", "warn"),
        ("hardware.xid", "fail"),
    }
    assert expected <= found, expected - found
    severities = [f["severity"] for f in report["findings"]]
    assert severities == sorted(severities, key=["fail", "warn", "info"].index)
    assert report["counts"]["fail"] == sum(s == "fail" for s in severities)
    assert report["summary"]["host"] == "h100-rental-03"


def test_doctor_from_shared_4090_box():
    proc = run_cli("doctor", "--from", SHARED, "--json")
    rules = {f["rule"]: f for f in json.loads(proc.stdout)["findings"]}
    assert rules["multi_gpu.p2p-unavailable"]["severity"] == "warn"  # GeForce: no P2P by design
    assert "storage.data-on-network-fs" in rules
    assert "gpu_memory.in-use" in rules
    assert "network.tcp-buffers" in rules
    assert "software.tf32-off" not in rules  # TF32 is no faster than fp32 on a 4090
    assert "multi_gpu.nvlink-down" not in rules


def test_doctor_terminal_report_groups_worst_first():
    proc = run_cli("doctor", "--from", FAULTY)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "h100-rental-03" in out
    badges = [w for w in out.split() if w in ("FAIL", "WARN", "INFO")]
    assert badges[0] == "FAIL"
    # areas come worst first: once an area whose worst finding is a WARN starts, no FAIL follows
    assert out.rindex(" FAIL ") < out.index("Distributed setup")
    assert "/dev/shm is only 64.0 MiB" in out


def test_doctor_strict_exits_1_on_fail():
    assert run_executable("doctor", "--from", FAULTY, "--strict").returncode == 1


def test_doctor_html_report_is_self_contained(tmp_path):
    page = tmp_path / "report.html"
    proc = run_cli("doctor", "--from", FAULTY, "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    html = page.read_text()
    assert html.startswith("<!doctype html>")
    assert "h100-rental-03" in html and "host.shm-small" in html
    assert "<script" not in html and "http://" not in html and "https://" not in html.split("</style>")[0]


def test_doctor_reads_snapshot_from_stdin():
    proc = run_executable("doctor", "--from", "-", "--json", stdin=Path(FAULTY).read_text())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["host"] == "h100-rental-03"


def test_list_rules():
    proc = run_cli("doctor", "--list-rules", "--json")
    rules = json.loads(proc.stdout)
    assert len(rules) >= 30
    assert {r["area"] for r in rules} >= {"hardware", "network", "storage", "host", "software"}


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"gpu": {}}', "schema_version"),
        ('{"schema_version": 99}', "newer"),
        ('{"schema_version": 1, "host": {"memory_total_bytes": "lots"}}', "host.memory_total_bytes"),
        ('{"schema_version": 1, "gpu": {"gpus": [{"name": "x"}]}}', "gpu.gpus.0.index"),
        ('{"schema_version": true}', "schema_version"),
        ('{"schema_version": 1, "gpu": {"gpus": [{"index": 0, "memory_total_bytes": -5}]}}', "negative"),
    ],
)
def test_bad_snapshot_is_one_line_and_exit_2(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert_one_line_error(run_cli("doctor", "--from", str(bad)), 2, needle, str(bad))


def test_missing_snapshot_file(tmp_path):
    assert_one_line_error(run_executable("doctor", "--from", str(tmp_path / "nope.json")), 2, "no such snapshot")


def test_binary_snapshot_file(tmp_path):
    bad = tmp_path / "bin.json"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(run_cli("doctor", "--from", str(bad)), 2)


def test_html_into_a_directory_is_refused_and_nothing_is_lost(tmp_path):
    assert_one_line_error(run_cli("doctor", "--from", FAULTY, "--html", str(tmp_path)), 2, "is a directory")


def test_outputs_never_replace_the_users_files(tmp_path):
    snap = tmp_path / "snap.json"
    snap.write_text(Path(FAULTY).read_text())
    before = snap.read_text()
    assert_one_line_error(run_cli("doctor", "--from", str(snap), "--html", str(snap)), 2, "input snapshot")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    assert_one_line_error(run_cli("doctor", "--from", str(snap), "--html", str(notes)), 2, "not written by redline")
    assert_one_line_error(run_cli("probe", "-o", str(notes)), 2, "not written by redline")
    assert snap.read_text() == before and notes.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "snap.json"]  # no temp files left


def test_rerunning_replaces_redline_own_outputs(tmp_path):
    page, snap = tmp_path / "r.html", tmp_path / "s.json"
    for _ in range(2):
        assert run_cli("doctor", "--from", FAULTY, "--html", str(page)).returncode == 0
        assert run_cli("probe", "-o", str(snap)).returncode == 0
    assert "<!doctype html>" in page.read_text()
    assert json.loads(snap.read_text())["schema_version"] == SCHEMA_VERSION


def test_missing_data_path_is_bad_input(tmp_path):
    assert_one_line_error(run_cli("doctor", "--data", str(tmp_path / "typo")), 2, "no such file")


def test_markup_in_names_is_printed_not_parsed(tmp_path):
    weird = tmp_path / "[bold]x[red].json"
    weird.write_text(Path(FAULTY).read_text().replace('"h100-rental-03"', '"box[/]one"'))
    proc = run_cli("doctor", "--from", str(weird))
    assert proc.returncode == 0, proc.stderr
    assert "box[/]one" in proc.stdout
    assert_one_line_error(run_cli("catalog", "gpus", "[/]"), 2, "[/]")


def test_unknown_option_is_a_usage_error():
    proc = run_executable("doctor", "--no-such-flag")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_every_command_has_json():
    for command in (["probe"], ["doctor"], ["catalog", "gpus"]):
        proc = run_cli(*command, "--help")
        assert proc.returncode == 0
        assert "--json" in proc.stdout, command


def test_run_cli_reports_the_commands_exit_code_when_the_forkserver_report_is_lost(monkeypatch):
    # Process.start in one thread polls every live child; when it reads a child's exit status from the
    # forkserver just before the thread waiting on that child does, the waiting thread reads end-of-file and
    # multiprocessing records 255 (seen in CI: `plan --nodes abc` "exited 255" with its usage error printed).
    # Here every report of an exit status is lost that way.
    from multiprocessing import forkserver

    read_signed = forkserver.read_signed
    reads: dict[int, int] = {}

    def taken_by_another_thread(fd: int) -> int:
        reads[fd] = reads.get(fd, 0) + 1
        value = read_signed(fd)
        if reads[fd] == 2:  # the first read is the pid, the second the exit status
            raise EOFError("unexpected EOF")
        return value

    monkeypatch.setattr(forkserver, "read_signed", taken_by_another_thread)
    result = run_cli("plan", "--nodes", "abc")
    assert result.returncode == 2, result
    assert "--nodes" in result.stderr
