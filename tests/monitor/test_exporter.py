"""The Prometheus exporter and the Grafana dashboard, checked against the real tools: the exposition of a
full 8-GPU sample (names, units, labels, None left out), ``promtool check metrics`` on it, a real
Prometheus server scraping the exporter and answering queries (the dashboard's included), and the HTTP
endpoint's errors."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prometheus_server import Prometheus, get, start_prometheus, stop
from redline.errors import BadInput
from redline.monitor.exporter import CLOCK_EVENT_REASONS, Exporter, ExporterServer, serve
from redline.monitor.sample import GpuProcess, GpuSample, HostSample, Sample, StepSample

pytestmark = pytest.mark.system

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "redline-grafana.json"
NOW = 1_700_000_000.0
GiB = 2**30

# The contract, written out independently of the exporter's tables: metric name -> dataclass field.
GPU_METRICS = {
    "redline_gpu_utilization_ratio": "utilization_ratio",
    "redline_gpu_memory_bandwidth_ratio": "memory_bandwidth_ratio",
    "redline_gpu_memory_used_bytes": "memory_used_bytes",
    "redline_gpu_memory_total_bytes": "memory_total_bytes",
    "redline_gpu_sm_clock_hertz": "sm_clock_hertz",
    "redline_gpu_sm_clock_max_hertz": "sm_clock_max_hertz",
    "redline_gpu_memory_clock_hertz": "memory_clock_hertz",
    "redline_gpu_memory_clock_max_hertz": "memory_clock_max_hertz",
    "redline_gpu_power_watts": "power_watts",
    "redline_gpu_power_limit_watts": "power_limit_watts",
    "redline_gpu_energy_joules_total": "energy_joules_total",
    "redline_gpu_temperature_celsius": "temperature_celsius",
    "redline_gpu_temperature_slowdown_celsius": "temperature_slowdown_celsius",
    "redline_gpu_pcie_tx_bytes_per_second": "pcie_tx_bytes_per_second",
    "redline_gpu_pcie_rx_bytes_per_second": "pcie_rx_bytes_per_second",
    "redline_gpu_pcie_link_generation": "pcie_link_generation",
    "redline_gpu_pcie_link_generation_max": "pcie_link_generation_max",
    "redline_gpu_pcie_link_width": "pcie_link_width",
    "redline_gpu_pcie_link_width_max": "pcie_link_width_max",
    "redline_gpu_pcie_replays_total": "pcie_replay_total",
    "redline_gpu_nvlink_tx_bytes_per_second": "nvlink_tx_bytes_per_second",
    "redline_gpu_nvlink_rx_bytes_per_second": "nvlink_rx_bytes_per_second",
    "redline_gpu_ecc_corrected_errors_total": "ecc_corrected_total",
    "redline_gpu_ecc_uncorrected_errors_total": "ecc_uncorrected_total",
    "redline_gpu_xid_errors_total": "xid_total",
    "redline_gpu_sm_activity_ratio": "sm_activity_ratio",
    "redline_gpu_tensor_activity_ratio": "tensor_activity_ratio",
}
HOST_METRICS = {
    "redline_host_cpu_utilization_ratio": "cpu_ratio",
    "redline_host_cpus": "cpu_count",
    "redline_host_cpu_iowait_ratio": "cpu_iowait_ratio",
    "redline_host_load1": "load_1m",
    "redline_host_memory_used_bytes": "memory_used_bytes",
    "redline_host_memory_total_bytes": "memory_total_bytes",
    "redline_host_swap_used_bytes": "swap_used_bytes",
    "redline_host_swap_in_bytes_per_second": "swap_in_bytes_per_second",
    "redline_host_swap_out_bytes_per_second": "swap_out_bytes_per_second",
    "redline_host_disk_read_bytes_per_second": "disk_read_bytes_per_second",
    "redline_host_disk_write_bytes_per_second": "disk_write_bytes_per_second",
    "redline_host_network_rx_bytes_per_second": "network_rx_bytes_per_second",
    "redline_host_network_tx_bytes_per_second": "network_tx_bytes_per_second",
}
TRAIN_METRICS = {
    "redline_train_step": "step",
    "redline_train_step_time_seconds": "time_s",
    "redline_train_data_wait_seconds": "data_s",
    "redline_train_compute_seconds": "compute_s",
    "redline_train_optimizer_seconds": "optimizer_s",
    "redline_train_comm_seconds": "comm_s",
    "redline_train_samples_per_second": "samples_per_s",
    "redline_train_tokens_per_second": "tokens_per_s",
    "redline_train_mfu_ratio": "mfu_catalog",
    "redline_train_peak_memory_bytes": "peak_memory_bytes",
    "redline_train_loss": "loss",
}
COUNTERS = {name for name in GPU_METRICS if name.endswith("_total")} | {"redline_samples_total"}


# ------------------------------------------------------------------------------------------- builders


def full_gpu(index: int) -> GpuSample:
    """Every field set, each value distinct per GPU, so a value landing on the wrong GPU shows."""
    reasons = {3: ["sw_power_cap", "hw_thermal_slowdown"], 5: ["unknown_0x800"]}.get(index, [])
    return GpuSample(
        index=index,
        uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        utilization_ratio=0.9 + index / 100,
        memory_bandwidth_ratio=0.5 + index / 100,
        memory_used_bytes=(40 + index) * GiB,
        memory_total_bytes=80 * GiB,
        sm_clock_hertz=1.755e9 + index * 1e6,
        sm_clock_max_hertz=1.98e9,
        memory_clock_hertz=2.619e9,
        memory_clock_max_hertz=2.619e9,
        clock_event_reasons=reasons,
        power_watts=300.5 + 10 * index,
        power_limit_watts=700.0,
        energy_joules_total=1e9 + index * 1e6,
        temperature_celsius=60.0 + index,
        temperature_slowdown_celsius=87.0,
        pcie_tx_bytes_per_second=1e9 + index,
        pcie_rx_bytes_per_second=2e9 + index,
        pcie_link_generation=5,
        pcie_link_generation_max=5,
        pcie_link_width=8 if index == 6 else 16,
        pcie_link_width_max=16,
        pcie_replay_total=index,
        nvlink_tx_bytes_per_second=1e11 + index,
        nvlink_rx_bytes_per_second=1.1e11 + index,
        ecc_corrected_total=2 * index,
        ecc_uncorrected_total=0,
        xid_total=1 if index == 2 else 0,
        sm_activity_ratio=0.7 + index / 100,
        tensor_activity_ratio=0.4 + index / 100,
        processes=[
            GpuProcess(pid=1000 + index, name="python", user="alice", used_memory_bytes=(39 + index) * GiB),
            GpuProcess(pid=4242, name=None, used_memory_bytes=GiB),  # another container: name unreadable
        ],
    )


def full_host() -> HostSample:
    return HostSample(
        cpu_ratio=0.35,
        cpu_count=192,
        cpu_iowait_ratio=0.04,
        load_1m=48.5,
        memory_used_bytes=900 * GiB,
        memory_total_bytes=2048 * GiB,
        swap_used_bytes=0,
        swap_in_bytes_per_second=0.0,
        swap_out_bytes_per_second=0.0,
        disk_read_bytes_per_second=3.2e9,
        disk_write_bytes_per_second=1.5e8,
        network_rx_bytes_per_second=4e9,
        network_tx_bytes_per_second=2e8,
    )


def full_step(rank: int, step: int = 100) -> StepSample:
    return StepSample(
        rank=rank,
        step=step,
        time_s=0.5 + rank / 1000,
        data_s=0.05 + rank / 1000,
        compute_s=0.4,
        optimizer_s=0.03,
        comm_s=0.02,
        samples_per_s=64.0,
        tokens_per_s=262144.0,
        mfu_catalog=0.41,
        peak_memory_bytes=60 * GiB,
        loss=2.5 - rank / 100,
    )


def full_sample(gpus: int = 8, time: float = NOW) -> Sample:
    """A sample with every field of every part set: what an 8-GPU H100 node training on 8 ranks reports."""
    return Sample(
        time=time,
        gpus=[full_gpu(i) for i in range(gpus)],
        host=full_host(),
        steps=[full_step(rank) for rank in range(gpus)],
    )


# -------------------------------------------------------------------------------------------- helpers

Series = dict[str, dict[frozenset[tuple[str, str]], float]]


def exposition(exporter: Exporter) -> str:
    return generate_latest(exporter.registry).decode()


def parse(text: str) -> tuple[Series, dict[str, str]]:
    """(sample name -> {label set -> value}, sample name -> the family's type) of an exposition."""
    series: Series = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
            types[sample.name] = family.type
    return series, types


def value(series: Series, name: str, **labels: str) -> float:
    return series[name][frozenset(labels.items())]


def exporter_with(sample: Sample, **kwargs: Any) -> Exporter:
    exporter = Exporter(clock=lambda: sample.time + 1.0, **kwargs)
    exporter.update(sample)
    return exporter


def uuid(index: int) -> str:
    return f"GPU-{index:08x}-0000-0000-0000-000000000000"


def numeric_fields(cls: type, leave_out: set[str]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - leave_out


# -------------------------------------------------------------------------------------------- exposition


def test_the_contract_covers_every_numeric_field_of_the_sample() -> None:
    """A field added to the schema must be exported (and added here) or it silently never reaches Grafana."""
    gpu_other = {"index", "uuid", "name", "lost", "clock_event_reasons", "processes"}
    assert set(GPU_METRICS.values()) == numeric_fields(GpuSample, gpu_other)
    assert set(HOST_METRICS.values()) == numeric_fields(HostSample, set())
    assert set(TRAIN_METRICS.values()) == numeric_fields(StepSample, {"rank"})


def test_full_8_gpu_sample_exports_every_field_under_its_base_unit_name() -> None:
    sample = full_sample()
    series, types = parse(exposition(exporter_with(sample)))
    for gpu in sample.gpus:
        labels = {"gpu": str(gpu.index), "uuid": gpu.uuid or ""}
        for name, attr in GPU_METRICS.items():
            assert value(series, name, **labels) == pytest.approx(getattr(gpu, attr)), (name, gpu.index)
    assert value(series, "redline_gpu_power_watts", gpu="3", uuid=uuid(3)) == 330.5
    assert value(series, "redline_gpu_memory_used_bytes", gpu="7", uuid=uuid(7)) == 47 * GiB
    assert value(series, "redline_gpu_sm_clock_hertz", gpu="1", uuid=uuid(1)) == 1.756e9
    for name, attr in HOST_METRICS.items():
        assert value(series, name) == pytest.approx(getattr(sample.host, attr)), name
    for step in sample.steps:
        for name, attr in TRAIN_METRICS.items():
            assert value(series, name, rank=str(step.rank)) == pytest.approx(getattr(step, attr)), name
        assert value(series, "redline_train_step_timestamp_seconds", rank=str(step.rank)) == NOW
    assert value(series, "redline_sample_timestamp_seconds") == NOW
    for name in COUNTERS:
        assert types[name] == "counter", name
    for name in set(series) - COUNTERS:
        assert not name.endswith("_total") or name.startswith("process_"), name
        if name.startswith("redline_"):
            assert types[name] in {"gauge", "info"}, name


def test_info_metric_names_model_uuid_driver_and_the_static_labels() -> None:
    exporter = exporter_with(full_sample(), driver_version="550.54.15", info_labels={"cuda": "12.4", "host": "n07"})
    series, _ = parse(exposition(exporter))
    info = series["redline_gpu_info"]
    assert len(info) == 8
    labels = dict(next(k for k in info if dict(k)["gpu"] == "4"))
    assert labels == {
        "gpu": "4",
        "uuid": uuid(4),
        "model": "NVIDIA H100 80GB HBM3",
        "driver": "550.54.15",
        "cuda": "12.4",
        "host": "n07",
    }
    assert set(info.values()) == {1.0}


@pytest.mark.parametrize("label", ["gpu", "driver", "1st", "bad-name", "__reserved"])
def test_info_labels_that_clash_or_are_not_label_names_are_refused(label: str) -> None:
    with pytest.raises(BadInput) as caught:
        Exporter(info_labels={label: "x"})
    assert "\n" not in str(caught.value) and label in str(caught.value)


def test_clock_event_reasons_are_one_0_or_1_series_per_known_reason_plus_any_unknown_set() -> None:
    series, _ = parse(exposition(exporter_with(full_sample())))
    reasons = series["redline_gpu_clock_event_reason"]
    on_gpu3 = {dict(k)["reason"]: v for k, v in reasons.items() if dict(k)["gpu"] == "3"}
    assert set(on_gpu3) == set(CLOCK_EVENT_REASONS) and len(CLOCK_EVENT_REASONS) == 11
    assert {r for r, v in on_gpu3.items() if v == 1.0} == {"sw_power_cap", "hw_thermal_slowdown"}
    on_gpu5 = {dict(k)["reason"]: v for k, v in reasons.items() if dict(k)["gpu"] == "5"}
    assert on_gpu5["unknown_0x800"] == 1.0 and sum(on_gpu5.values()) == 1.0
    on_gpu0 = {dict(k)["reason"]: v for k, v in reasons.items() if dict(k)["gpu"] == "0"}
    assert len(on_gpu0) == 11 and sum(on_gpu0.values()) == 0.0


def test_none_fields_are_absent_not_zero() -> None:
    sparse = GpuSample(index=0, uuid=None, name=None, power_watts=0.0, clock_event_reasons=None)
    text = exposition(exporter_with(Sample(time=NOW, gpus=[sparse])))
    series, _ = parse(text)
    assert value(series, "redline_gpu_power_watts", gpu="0", uuid="") == 0.0  # a real 0 stays
    redline = {name for name in series if name.startswith("redline_")}
    assert redline == {
        "redline_monitor_up",
        "redline_samples_total",
        "redline_sample_age_seconds",
        "redline_sample_timestamp_seconds",
        "redline_gpu_info",
        "redline_gpu_lost",
        "redline_gpu_power_watts",
    }
    assert "redline_gpu_temperature_celsius" not in text  # not even HELP/TYPE lines for an empty family
    assert "redline_host_" not in text and "redline_train_" not in text and "clock_event_reason" not in text


def test_a_lost_gpu_reports_lost_and_nothing_it_cannot_know() -> None:
    sample = full_sample(gpus=2)
    sample.gpus[1] = GpuSample(index=1, uuid=uuid(1), lost=True)
    series, _ = parse(exposition(exporter_with(sample)))
    assert value(series, "redline_gpu_lost", gpu="1", uuid=uuid(1)) == 1.0
    assert value(series, "redline_gpu_lost", gpu="0", uuid=uuid(0)) == 0.0
    gpu1 = {name for name, by_labels in series.items() for k in by_labels if ("gpu", "1") in k}
    assert gpu1 == {"redline_gpu_info", "redline_gpu_lost"}


def test_process_memory_is_labelled_by_gpu_pid_name_and_summed_when_listed_twice() -> None:
    sample = full_sample(gpus=2)
    sample.gpus[0].processes.append(GpuProcess(pid=1000, name="python", used_memory_bytes=GiB))  # listed again
    sample.gpus[0].processes.append(GpuProcess(pid=77, name="x", used_memory_bytes=None))  # memory not readable
    series, _ = parse(exposition(exporter_with(sample)))
    procs = {tuple(sorted(k)): v for k, v in series["redline_gpu_process_memory_used_bytes"].items()}
    gpu0 = {dict(k)["pid"]: (dict(k)["name"], v) for k, v in procs.items() if dict(k)["gpu"] == "0"}
    assert gpu0 == {"1000": ("python", 40 * GiB), "4242": ("", GiB)}
    assert len(procs) == 4


def test_each_rank_keeps_its_newest_step_until_a_newer_one_arrives() -> None:
    exporter = Exporter(clock=lambda: NOW)
    exporter.update(Sample(time=NOW - 2, steps=[full_step(0, 10), full_step(0, 11), full_step(1, 11)]))
    exporter.update(Sample(time=NOW - 1, steps=[full_step(0, 12)]))  # rank 1 finished no step this interval
    series, _ = parse(exposition(exporter))
    assert value(series, "redline_train_step", rank="0") == 12
    assert value(series, "redline_train_step", rank="1") == 11
    assert value(series, "redline_train_step_timestamp_seconds", rank="0") == NOW - 1
    assert value(series, "redline_train_step_timestamp_seconds", rank="1") == NOW - 2
    assert value(series, "redline_samples_total") == 2


def test_freshness_up_goes_to_0_before_the_first_sample_and_when_sampling_stalls() -> None:
    now = [NOW]
    exporter = Exporter(stale_after_s=5.0, clock=lambda: now[0])
    series, _ = parse(exposition(exporter))
    assert value(series, "redline_monitor_up") == 0.0
    assert value(series, "redline_samples_total") == 0
    assert "redline_sample_age_seconds" not in series and "redline_gpu_info" not in series
    exporter.update(full_sample(time=NOW))
    now[0] = NOW + 4.0
    series, _ = parse(exposition(exporter))
    assert value(series, "redline_monitor_up") == 1.0
    assert value(series, "redline_sample_age_seconds") == 4.0
    now[0] = NOW + 6.0
    series, _ = parse(exposition(exporter))
    assert value(series, "redline_monitor_up") == 0.0
    assert value(series, "redline_sample_age_seconds") == 6.0
    assert value(series, "redline_gpu_power_watts", gpu="3", uuid=uuid(3)) == 330.5  # the last values stay


def test_a_scrape_never_mixes_two_samples_while_the_sampler_updates() -> None:
    """Samples k carry time k and power k on all 8 GPUs; every scrape must show one k throughout."""
    exporter = Exporter(process_metrics=False, clock=lambda: NOW)
    exporter.update(full_sample(time=0.0))
    stop = threading.Event()

    def sampler() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            sample = full_sample(time=float(k))
            for gpu in sample.gpus:
                gpu.power_watts = float(k)
            exporter.update(sample)

    writer = threading.Thread(target=sampler, daemon=True)
    writer.start()
    seen: set[float] = set()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            series, _ = parse(exposition(exporter))
            stamp = value(series, "redline_sample_timestamp_seconds")
            powers = set(series["redline_gpu_power_watts"].values())
            assert len(series["redline_gpu_power_watts"]) == 8
            assert powers == {stamp} or stamp == 0.0, (stamp, powers)
            seen.add(stamp)
    finally:
        stop.set()
        writer.join(5)
    assert len(seen) > 2  # the writer really did run between scrapes


# -------------------------------------------------------------------------------------------- promtool


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_check_metrics_finds_no_problem_in_the_full_exposition() -> None:
    text = exposition(exporter_with(full_sample(), driver_version="550.54.15"))
    assert "process_resident_memory_bytes" in text  # the exporter's own cost is part of what is linted
    done = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30, check=False
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_promtool_check_metrics_does_flag_a_bad_name_so_the_check_above_means_something() -> None:
    bad = "# HELP x_latency_milliseconds x\n# TYPE x_latency_milliseconds gauge\nx_latency_milliseconds 1\n"
    done = subprocess.run(
        [promtool(), "check", "metrics"], input=bad, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode != 0 and "base unit" in done.stdout + done.stderr


# -------------------------------------------------------------------------------------------- HTTP


@pytest.fixture
def served() -> Iterator[tuple[Exporter, ExporterServer]]:
    exporter = Exporter()
    exporter.update(full_sample(time=time.time()))
    server = serve(exporter, port=0)
    try:
        yield exporter, server
    finally:
        server.shutdown()


def test_serves_on_loopback_by_default_and_frees_the_port_on_shutdown() -> None:
    exporter = exporter_with(full_sample())
    server = serve(exporter, port=0)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        series, _ = parse(get(server.url))
        assert value(series, "redline_gpu_power_watts", gpu="3", uuid=uuid(3)) == 330.5
    finally:
        server.shutdown()
    server.shutdown()  # twice is harmless
    with pytest.raises(OSError):
        get(server.url, timeout=2)
    again = serve(exporter, port=server.port)  # the port is free again
    again.close()


def test_a_port_in_use_is_one_clear_line() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BadInput) as caught:
            serve(Exporter(), port=port)
    assert str(caught.value) == f"port {port} on 127.0.0.1 is in use: pick another with --port"


@pytest.mark.parametrize(
    ("host", "port", "says"),
    [
        ("127.0.0.1", 70000, "not a TCP port"),
        ("192.0.2.1", 0, "not an address of this machine"),  # TEST-NET-1: never one of ours
        ("no-such-host.invalid", 0, "cannot resolve"),
    ],
)
def test_an_address_we_cannot_listen_on_is_one_clear_line(host: str, port: int, says: str) -> None:
    with pytest.raises(BadInput) as caught:
        serve(Exporter(), host=host, port=port)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_scrapes_over_http_answer_quickly(served: tuple[Exporter, ExporterServer]) -> None:
    """A sanity bound only, generous for a loaded CI machine: benchmarks/monitor_scrape.py measures it."""
    _, server = served
    times = []
    for _ in range(20):
        start = time.perf_counter()
        get(server.url)
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.5


# -------------------------------------------------------------------------------------------- dashboard


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:redline|process)_[a-z0-9_]+\b", expr))


def concrete(expr: str) -> str:
    """The query Grafana would send with every server, job and GPU selected."""
    for variable, stands_for in {"$__rate_interval": "15s", "$__range": "5m"}.items():
        expr = expr.replace(variable, stands_for)
    expr = re.sub(r"\$(instance|job|gpu)\b", ".*", expr)
    assert "$" not in expr, expr
    return expr


def test_dashboard_is_an_importable_grafana_dashboard_with_the_variables() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["gpu"]["query"]["query"].startswith("label_values(redline_gpu_info")
    assert variables["gpu"]["multi"] and variables["gpu"]["includeAll"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for y in range(pos["y"], pos["y"] + pos["h"]):
            for x in range(pos["x"], pos["x"] + pos["w"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]


def test_dashboard_has_the_panels_the_issue_asks_for() -> None:
    titles = " | ".join(p["title"].lower() for p in panels())
    for topic in ["utilisation", "memory used", "sm clock vs max", "power vs limit", "temperature", "throttling"]:
        assert topic in titles, topic
    for topic in ["pcie throughput", "pcie link width", "nvlink", "ecc", "xid", "per process", "cpu and iowait"]:
        assert topic in titles, topic
    for topic in ["swap", "input pipeline: data wait vs step time", "throughput", "mfu"]:
        assert topic in titles, topic
    timeline = next(p for p in panels() if "throttling" in p["title"].lower())
    assert timeline["type"] == "state-timeline"


def test_every_metric_the_dashboard_queries_is_one_the_exporter_exports_and_vice_versa() -> None:
    exported, _ = parse(exposition(exporter_with(full_sample())))
    used = set().union(*(metric_names(e) for e in exprs()))
    assert used, "no metric names found in the dashboard's queries"
    assert used - set(exported) == set()
    shown = {name for name in exported if name.startswith("redline_")}
    assert shown - used == {"redline_samples_total"}  # for alerts (rate() == 0), not a panel


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    queries = exprs()
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(e)} for i, e in enumerate(queries)]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")  # JSON is YAML
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout


# -------------------------------------------------------------------------------------------- real Prometheus


@pytest.fixture
def prometheus(served: tuple[Exporter, ExporterServer], tmp_path: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    _, server = served
    running = start_prometheus(binary, tmp_path, f"127.0.0.1:{server.port}")
    try:
        yield running
    finally:
        stop(running.process)


def test_real_prometheus_scrapes_the_exporter_and_answers_the_dashboards_queries(
    served: tuple[Exporter, ExporterServer], prometheus: Prometheus
) -> None:
    exporter, _ = served
    served_text = exposition(exporter)
    expected = value(parse(served_text)[0], "redline_gpu_power_watts", gpu="3", uuid=uuid(3))
    power = 'redline_gpu_power_watts{gpu="3"}'
    result = prometheus.wait_for(power, lambda r: bool(r), "the first scrape never arrived")
    assert [float(series["value"][1]) for series in result] == [expected]
    labels = result[0]["metric"]
    assert labels["uuid"] == uuid(3) and labels["job"] == "redline" and labels["__name__"] == "redline_gpu_power_watts"

    # a new sample reaches Prometheus at the next scrape: it really is live, not a value that happened to match
    sample = full_sample(time=time.time())
    sample.gpus[3].power_watts = 612.25
    exporter.update(sample)
    prometheus.wait_for(power, lambda r: [float(s["value"][1]) for s in r] == [612.25], "the update never arrived")
    up = prometheus.query('up{job="redline"}')
    assert [float(s["value"][1]) for s in up] == [1.0]

    # every dashboard query gives data (rate() and increase() need two scrapes: wait_for polls until then)
    for expr in exprs():
        prometheus.wait_for(concrete(expr), lambda r: bool(r), "a dashboard query stayed empty")
