"""Saved bench runs: per-machine fingerprint, round trip, and `redline doctor --bench` reading them."""

from __future__ import annotations

import json

import pytest

from builders import healthy_server
from conftest import FIXTURES, run_cli
from redline.bench import store
from redline.bench.model import BenchRun, Measurement, Spread
from redline.errors import BadInput
from redline.hw.snapshot import load_snapshot


@pytest.fixture
def redline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path))
    return tmp_path


def test_fingerprint_names_the_machine_not_the_moment():
    a, _ = store.fingerprint(healthy_server())
    b, machine = store.fingerprint(healthy_server())
    assert a == b and len(a) == 12
    other = healthy_server()
    other.gpu.gpus[0].uuid = "GPU-replaced"
    assert store.fingerprint(other)[0] != a
    assert machine["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"


def test_save_load_round_trip(redline_home):
    fingerprint, machine = store.fingerprint(healthy_server())
    run = BenchRun(
        fingerprint,
        machine,
        "2026-11-29T12:00:00+00:00",
        [
            Measurement(
                "compute",
                "matmul_bf16",
                790.0,
                "TFLOP/s",
                "torch.matmul",
                device="cuda:0",
                repeats=20,
                spread=Spread.of([780.0, 790.0, 795.0]),
                peak=989.4,
                peak_source="catalog",
            )
        ],
    )
    path = store.save(run)
    assert path.parent == redline_home / "bench" / fingerprint
    assert store.saved_runs(fingerprint) == [path]
    loaded = store.load(path)
    assert loaded.measurements[0].spread.median == 790.0
    assert loaded.measurements[0].ratio == pytest.approx(790 / 989.4)


@pytest.mark.parametrize("content", ["not json", "[]", '{"schema_version": 1}', '{"schema_version": 7}'])
def test_malformed_results_are_bad_input(tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(BadInput):
        store.load(bad)


def test_doctor_bench_reads_the_run_saved_for_the_snapshots_machine(redline_home):
    snapshot = load_snapshot(FIXTURES / "h100x8-faulty.json")
    fingerprint, machine = store.fingerprint(snapshot)
    gemm = Measurement(
        "compute",
        "matmul_bf16",
        400.0,
        "TFLOP/s",
        "torch.matmul",
        device="cuda:5",
        peak=989.4,
        peak_source="catalog",
        extra={"gpu_state": {"5": {"clock_event_reasons": ["hw_thermal_slowdown"]}}},
    )
    disk = Measurement("storage", "seq_read", 2500.0, "MB/s", "m")
    older = store.save(BenchRun(fingerprint, machine, "2026-11-29T11:00:00+00:00", [disk]))
    saved = store.save(BenchRun(fingerprint, machine, "2026-11-29T12:00:00+00:00", [gemm]))
    proc = run_cli(
        "doctor",
        "--from",
        str(FIXTURES / "h100x8-faulty.json"),
        "--bench",
        "--json",
        env={"REDLINE_HOME": str(redline_home)},
    )
    assert proc.returncode == 0, proc.stderr
    rules = {f["rule"]: f for f in json.loads(proc.stdout)["findings"]}
    assert rules["power_thermal.gemm-below-peak"]["severity"] == "fail"
    # which file it judged, said once on stderr (stdout stays JSON)
    said = " ".join(proc.stderr.split())
    assert f"judging the bench results in {saved} (taken 2026-11-29T12:00:00+00:00)" in said
    assert "from 1 older run beside it" in said

    named = run_cli("doctor", "--from", str(FIXTURES / "h100x8-faulty.json"), "--bench-file", str(older))
    assert named.returncode == 0 and f"judging the bench results in {older}" in " ".join(named.stderr.split())


def test_doctor_bench_without_saved_results_is_bad_input(redline_home):
    proc = run_cli(
        "doctor", "--from", str(FIXTURES / "h100x8-faulty.json"), "--bench", env={"REDLINE_HOME": str(redline_home)}
    )
    assert proc.returncode == 2 and "redline bench --save" in proc.stderr and "Traceback" not in proc.stderr


def test_latest_keeps_the_newest_figure_of_each_kind(redline_home):
    fingerprint, machine = store.fingerprint(healthy_server())
    old_gemm = Measurement("compute", "matmul_bf16", 500.0, "TFLOP/s", "m", device="cuda:0")
    new_gemm = Measurement("compute", "matmul_bf16", 790.0, "TFLOP/s", "m", device="cuda:0")
    disk = Measurement("storage", "seq_read", 2500.0, "MB/s", "m")
    store.save(BenchRun(fingerprint, machine, "2026-11-29T10:00:00+00:00", [old_gemm]))
    store.save(BenchRun(fingerprint, machine, "2026-11-29T11:00:00+00:00", [disk], quick=True))
    store.save(BenchRun(fingerprint, machine, "2026-11-29T12:00:00+00:00", [new_gemm]))
    merged = {m.name: m for m in store.latest(fingerprint).measurements}
    assert merged["matmul_bf16"].value == 790.0
    assert merged["seq_read"].value == 2500.0 and merged["seq_read"].extra["quick"] is True
    assert merged["matmul_bf16"].extra["quick"] is False


def test_quick_gemm_gets_no_verdict():
    from redline.doctor.engine import run_rules

    gemm = Measurement(
        "compute", "matmul_bf16", 300.0, "TFLOP/s", "m", device="cuda:0", peak=989.4, extra={"quick": True}
    )
    run = BenchRun("f" * 12, {}, "2026-11-29T12:00:00+00:00", [gemm], quick=True)
    assert "power_thermal.gemm-below-peak" not in {f.rule for f in run_rules(healthy_server(), bench=run).findings}
