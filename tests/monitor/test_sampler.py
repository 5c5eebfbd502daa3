"""The monitor's sampler: every field from the fake NVML in base units, host rates, step tailing, NVML going
away and coming back, the cadence loop, bounded state; and the trace fixtures it is tested with."""

from __future__ import annotations

import json
import os
import pwd
import sys
import threading
from collections import namedtuple
from pathlib import Path
from typing import Any

import pynvml
import pytest

from fakes.fake_nvml import (
    HW_THERMAL,
    SW_POWER_CAP,
    FakeNvml,
    FakeProcess,
    MiB,
    a100_sxm_80,
    eight_gpu_server,
    h100_sxm,
    rtx_4090,
)
from fakes.traces import FOREIGN_PID, SCENARIOS, FakeClock, scenario
from redline.hw.host_state import HostReading, host_sample, read_host
from redline.monitor.sample import Sample
from redline.monitor.sampler import Sampler, StepTail, run_sampler
from sysroot import SysRoot

T0 = 1_700_000_000.0


def user_name(uid: int) -> str:
    """What the sampler should call a uid on this machine."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def make_sampler(nvml: Any, clock: FakeClock, **kwargs: Any) -> Sampler:
    """A sampler on fakes only: no psutil, no dmesg, no real /proc unless a test passes them."""
    arguments: dict[str, Any] = {
        "nvml": nvml,
        "clock": clock,
        "monotonic": clock,
        "host": None,
        "kernel_log": None,
        "proc_root": "/nonexistent-proc-root",
    }
    return Sampler(**(arguments | kwargs))


def gpuless_sampler(clock: FakeClock, **kwargs: Any) -> Sampler:
    """A sampler on a server without GPUs (NVML starts and counts none), for tests of the rest."""
    return make_sampler(FakeNvml([]), clock, **kwargs)


def step_line(rank: int, step: int, **overrides: Any) -> str:
    record = {
        "step": step,
        "time_s": 1.5,
        "data_s": 0.02,
        "compute_s": 1.3,
        "optimizer_s": 0.08,
        "comm_s": 0.1,
        "samples": 64,
        "tokens": 131072,
        "samples_per_s": 42.7,
        "tokens_per_s": 87381.3,
        "mfu_catalog": 0.46,
        "mfu_measured": None,
        "peak_memory_bytes": 70 << 30,
        "loss": 2.5,
        "micro_batch": 2,
        "accumulation": 4,
        "skipped": False,
        "rank": rank,
    }
    return json.dumps(record | overrides) + "\n"


def append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------- GPU fields


def test_every_gpu_field_from_the_fake_in_base_units(tmp_path: Path) -> None:
    gpu = h100_sxm(
        0,
        utilization_pct=97,
        memory_utilization_pct=41,
        memory_used_mib=70_000,
        sm_clock_mhz=1755,
        clock_event_reasons=SW_POWER_CAP | HW_THERMAL,
        power_draw_mw=612_345,
        power_limit_mw=650_000,
        energy_mj=1_000_000,
        temperature_c=71,
        pcie_gen=4,
        pcie_width=8,
        pcie_replay=3,
        ecc_volatile_corrected=5,
        ecc_volatile_uncorrected=1,
        gpm_sm_util_pct=81.5,
        gpm_tensor_util_pct=47.25,
        processes=[FakeProcess(4242, used_memory=1234 * MiB)],
    )
    nvml = FakeNvml([gpu, h100_sxm(1)])
    root = SysRoot(tmp_path)
    root.add_process(4242, "python", 1234)
    log = (
        "NVRM: Xid (PCI:0000:18:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"
        "NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception\n"
        "NVRM: Xid (0000:18:00): 31, pid=4242, MMU Fault\n"  # an older driver leaves out "PCI:"
        "NVRM: Xid (PCI:0000:2a:00): 48, DBE\n"
    )
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock, kernel_log=lambda: log, proc_root=tmp_path)

    first = sampler.sample()
    gpu.pcie_tx_bytes_total += 3_000_000_000
    gpu.pcie_rx_bytes_total += 8_000_000_000
    gpu.nvlink_tx_kib_total += 2_000_000
    gpu.nvlink_rx_kib_total += 500_000
    gpu.energy_mj += 1_300_000
    clock.advance(2.0)
    second = sampler.sample()

    assert first.time == T0 and second.time == T0 + 2
    g = second.gpus[0]
    assert (g.index, g.uuid, g.name, g.lost) == (0, gpu.uuid, "NVIDIA H100 80GB HBM3", False)
    assert g.utilization_ratio == pytest.approx(0.97)
    assert g.memory_bandwidth_ratio == pytest.approx(0.41)
    assert g.memory_used_bytes == 70_000 * MiB and g.memory_total_bytes == 81559 * MiB
    assert g.sm_clock_hertz == 1755e6 and g.sm_clock_max_hertz == 1980e6
    assert g.memory_clock_hertz == 2619e6 and g.memory_clock_max_hertz == 2619e6
    assert g.clock_event_reasons == ["sw_power_cap", "hw_thermal_slowdown"]
    assert g.power_watts == pytest.approx(612.345) and g.power_limit_watts == 650.0
    assert g.energy_joules_total == pytest.approx(2300.0)  # mJ -> J
    assert g.temperature_celsius == 71 and g.temperature_slowdown_celsius == 90
    assert g.pcie_tx_bytes_per_second == pytest.approx(1.5e9)  # byte counters over 2 s
    assert g.pcie_rx_bytes_per_second == pytest.approx(4e9)
    assert (g.pcie_link_generation, g.pcie_link_generation_max) == (4, 5)
    assert (g.pcie_link_width, g.pcie_link_width_max) == (8, 16)
    assert g.pcie_replay_total == 3
    assert g.nvlink_tx_bytes_per_second == pytest.approx(2_000_000 * 1024 / 2)  # KiB counters
    assert g.nvlink_rx_bytes_per_second == pytest.approx(500_000 * 1024 / 2)
    assert (g.ecc_corrected_total, g.ecc_uncorrected_total) == (5, 1)
    assert g.xid_total == 3
    assert g.sm_activity_ratio == pytest.approx(0.815) and g.tensor_activity_ratio == pytest.approx(0.4725)
    assert [(p.pid, p.name, p.user, p.used_memory_bytes, p.kind) for p in g.processes] == [
        (4242, "python", user_name(1234), 1234 * MiB, "compute")
    ]
    other = second.gpus[1]
    assert other.xid_total == 1 and other.pcie_tx_bytes_per_second == 0.0 and other.processes == []
    assert first.notes == [] and second.notes == []


def test_rates_and_gpm_need_two_samples() -> None:
    sampler = make_sampler(eight_gpu_server(), FakeClock(T0))
    first = sampler.sample().gpus[0]
    assert first.pcie_tx_bytes_per_second is None and first.nvlink_rx_bytes_per_second is None
    assert first.sm_activity_ratio is None and first.tensor_activity_ratio is None
    assert first.energy_joules_total is not None  # a counter, not a rate


def test_a_counter_that_goes_down_gives_no_rate_for_that_interval() -> None:
    nvml = FakeNvml([h100_sxm(0)])
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    sampler.sample()
    nvml.gpus[0].pcie_tx_bytes_total = 10  # the driver reloaded behind our back
    clock.advance(1)
    assert sampler.sample().gpus[0].pcie_tx_bytes_per_second is None
    nvml.gpus[0].pcie_tx_bytes_total += 4096
    clock.advance(1)
    assert sampler.sample().gpus[0].pcie_tx_bytes_per_second == pytest.approx(4096)


def test_without_pcie_counters_the_blocking_throughput_call_is_refreshed_one_gpu_per_sample() -> None:
    # a driver before r550: only nvmlDeviceGetPcieThroughput, which blocks 20 ms per direction
    nvml = FakeNvml([rtx_4090(0, pcie_tx_kbps=100, pcie_rx_kbps=250), rtx_4090(1, pcie_tx_kbps=7, pcie_rx_kbps=9)])
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    first = sampler.sample()
    assert nvml.calls.count("nvmlDeviceGetPcieThroughput") == 2  # one GPU, both directions
    assert first.gpus[0].pcie_tx_bytes_per_second == 100 * 1024  # KiB/s -> bytes/s
    assert first.gpus[0].pcie_rx_bytes_per_second == 250 * 1024
    assert first.gpus[1].pcie_tx_bytes_per_second is None
    clock.advance(1)
    second = sampler.sample()
    assert nvml.calls.count("nvmlDeviceGetPcieThroughput") == 4
    assert second.gpus[0].pcie_tx_bytes_per_second == 100 * 1024  # the last reading, kept
    assert second.gpus[1].pcie_rx_bytes_per_second == 9 * 1024


def test_what_a_board_does_not_support_is_none_without_notes_and_not_asked_again() -> None:
    nvml = FakeNvml([rtx_4090(0)])
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    samples = [sampler.sample()]
    for _ in range(3):
        clock.advance(1)
        samples.append(sampler.sample())
    g = samples[-1].gpus[0]
    assert g.ecc_corrected_total is None and g.ecc_uncorrected_total is None
    assert g.nvlink_tx_bytes_per_second is None and g.nvlink_rx_bytes_per_second is None
    assert g.sm_activity_ratio is None and g.tensor_activity_ratio is None  # no GPM before Hopper
    assert g.utilization_ratio == pytest.approx(0.03) and g.energy_joules_total == pytest.approx(96_500)
    assert all(s.notes == [] for s in samples)
    assert nvml.calls.count("nvmlDeviceGetTotalEccErrors") == 2  # the first sample's two, then never again
    assert "nvmlGpmSampleAlloc" not in nvml.calls


def test_a100_has_nvlink_rates_but_no_gpm() -> None:
    nvml = FakeNvml([a100_sxm_80(0, nvlink_tx_kibps=1_000_000)])
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    sampler.sample()
    nvml.gpus[0].run_for(1.0)
    clock.advance(1)
    g = sampler.sample().gpus[0]
    assert g.nvlink_tx_bytes_per_second == pytest.approx(1_000_000 * 1024)
    assert g.sm_activity_ratio is None


def test_an_older_binding_without_newer_calls_reads_the_rest() -> None:
    missing = {"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetFieldValues", "nvmlGpmSampleAlloc"}
    nvml = eight_gpu_server(missing=missing)
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    sampler.sample()
    clock.advance(1)
    sample = sampler.sample()
    g = sample.gpus[0]
    assert g.energy_joules_total is None and g.nvlink_tx_bytes_per_second is None and g.sm_activity_ratio is None
    assert g.pcie_tx_bytes_per_second is not None or sample.gpus[1].pcie_tx_bytes_per_second is not None
    assert g.power_watts == pytest.approx(71.0) and sample.notes == []


def test_an_error_is_a_none_and_one_note_not_one_per_sample() -> None:
    nvml = eight_gpu_server(faults={2: {"errors": {"nvmlDeviceGetPowerUsage": pynvml.NVMLError_Unknown()}}})
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    notes = []
    for _ in range(4):
        sample = sampler.sample()
        assert sample.gpus[2].power_watts is None and sample.gpus[2].power_limit_watts == 700.0
        notes += sample.notes
        clock.advance(1)
    assert notes == ["GPU 2: nvmlDeviceGetPowerUsage: Unknown Error"]


def test_the_driver_version_is_known_before_the_first_sample_and_nvml_is_started_once() -> None:
    nvml = eight_gpu_server(driver="550.54.15")
    sampler = make_sampler(nvml, FakeClock(T0))
    assert sampler.driver_version == "550.54.15"
    assert len(sampler.sample().gpus) == 8
    assert nvml.calls.count("nvmlInit") == 1
    without = make_sampler(eight_gpu_server(init_error=pynvml.NVMLError_LibraryNotFound()), FakeClock(T0))
    assert without.driver_version is None
    assert without.sample().notes == [
        "no GPU telemetry: NVML library not found (no NVIDIA driver) (trying again every 10 s)"
    ]


def test_only_the_gpus_asked_for(tmp_path: Path) -> None:
    sampler = make_sampler(eight_gpu_server(), FakeClock(T0), indices=[5, 1, 9])
    sample = sampler.sample()
    assert [g.index for g in sample.gpus] == [1, 5]
    assert sample.notes == ["GPU 9: not there (NVML counts 8 GPUs)"]


# ------------------------------------------------------------------------------------------- NVML away


def test_one_lost_gpu_is_marked_and_the_others_go_on() -> None:
    nvml = eight_gpu_server()
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock)
    sampler.sample()
    nvml.gpus[3].lost = True
    clock.advance(1)
    sample = sampler.sample()
    lost = sample.gpus[3]
    assert lost.lost and lost.uuid == nvml.gpus[3].uuid and lost.power_watts is None and lost.processes == []
    assert not any(g.lost for g in sample.gpus if g.index != 3)
    assert sample.gpus[4].power_watts is not None
    assert nvml.calls.count("nvmlInit") == 1  # one lost GPU is no reason to restart NVML


def test_nvml_going_away_marks_gpus_lost_keeps_host_and_steps_and_comes_back(tmp_path: Path) -> None:
    nvml = eight_gpu_server()
    clock = FakeClock(T0)
    steps = tmp_path / "steps-0.jsonl"
    steps.write_text("")
    host = FakeHostReader()
    sampler = make_sampler(nvml, clock, host=host, step_paths=[steps], reinit_interval_s=10)
    assert not any(g.lost for g in sampler.sample().gpus)

    nvml.unload()
    samples = []
    for second in range(1, 25):
        if second == 15:
            nvml.reload()
        clock.advance(1)
        append(steps, step_line(0, second))
        samples.append(sampler.sample())

    gone = samples[0]
    assert len(gone.gpus) == 8 and all(g.lost and g.uuid for g in gone.gpus)
    assert gone.notes[0].startswith("NVML stopped answering (nvmlDeviceGetUtilizationRates: Uninitialized)")
    assert all(s.host is not None and len(s.steps) == 1 for s in samples)  # the rest carries on
    # NVML is started again no more often than every 10 s: at +11 (still unloaded), then at +21
    assert nvml.calls.count("nvmlInit") == 3
    back = next(i for i, s in enumerate(samples) if not s.gpus[0].lost)
    assert back == 20  # second 21
    assert any(n.startswith("NVML is back after 20 s with 8 GPUs") for n in samples[back].notes)
    assert samples[back].gpus[0].power_watts is not None
    assert samples[back].gpus[0].pcie_tx_bytes_per_second is None  # rates start again
    assert samples[back + 1].gpus[0].pcie_tx_bytes_per_second is not None
    assert nvml.active_inits == 1


def test_every_gpu_lost_restarts_nvml_later() -> None:
    nvml = eight_gpu_server()
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock, reinit_interval_s=5)
    sampler.sample()
    for gpu in nvml.gpus:
        gpu.lost = True
    clock.advance(1)
    lost = sampler.sample()
    assert all(g.lost for g in lost.gpus) and lost.notes[0].startswith("every GPU answers GPU_IS_LOST")
    assert nvml.active_inits == 0  # shut down, to start afresh
    for gpu in nvml.gpus:
        gpu.lost = False
    clock.advance(2)
    assert all(g.lost for g in sampler.sample().gpus)  # too soon to try again
    clock.advance(3)
    sample = sampler.sample()
    assert not any(g.lost for g in sample.gpus) and any(n.startswith("NVML is back") for n in sample.notes)


def test_nvml_failing_to_start_gives_no_gpus_and_one_note_and_retries_slowly() -> None:
    nvml = eight_gpu_server(init_error=pynvml.NVMLError_DriverNotLoaded())
    clock = FakeClock(T0)
    sampler = make_sampler(nvml, clock, host=FakeHostReader(), reinit_interval_s=10)
    samples = []
    for _ in range(25):
        samples.append(sampler.sample())
        clock.advance(1)
    assert all(s.gpus == [] and s.host is not None for s in samples)
    assert samples[0].notes == [
        "no GPU telemetry: NVIDIA driver not loaded (the nvidia kernel module is not running) (trying again every 10 s)"
    ]
    assert all(s.notes == [] for s in samples[1:])
    assert nvml.calls.count("nvmlInit") == 3  # at 0, 10 and 20 s


def test_without_pynvml_there_are_no_gpus_and_a_note_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    sampler = Sampler(host=FakeHostReader(), kernel_log=None)
    sample = sampler.sample()
    assert sample.gpus == [] and sample.host is not None
    assert sample.notes == ["no GPU telemetry: nvidia-ml-py (pynvml) is not installed"]
    assert sampler.sample().notes == []


def test_the_product_path_talks_to_the_real_pynvml() -> None:
    # this machine may or may not have a driver: either GPUs, or no GPUs and a note that says why
    with Sampler(kernel_log=None) as sampler:
        sample = sampler.sample()
    assert sample.host is not None and sample.host.cpu_count
    if not sample.gpus:
        assert any(n.startswith("no GPU telemetry: ") for n in sample.notes)


def test_xids_are_read_from_the_kernel_log_at_most_every_30_s() -> None:
    reads = []

    def kernel_log() -> str | None:
        reads.append(1)
        return "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.\n" * len(reads)

    clock = FakeClock(T0)
    sampler = make_sampler(eight_gpu_server(), clock, kernel_log=kernel_log)
    totals = []
    for _ in range(40):
        totals.append(sampler.sample().gpus[0].xid_total)
        clock.advance(1)
    assert len(reads) == 2
    assert totals[0] == 1 and totals[29] == 1 and totals[30] == 2


def test_an_unreadable_kernel_log_leaves_xids_none_with_one_note() -> None:
    clock = FakeClock(T0)
    sampler = make_sampler(eight_gpu_server(), clock, kernel_log=lambda: None, xid_interval_s=0)
    first, second = sampler.sample(), sampler.sample()
    assert first.gpus[0].xid_total is None
    assert first.notes == ["Xid counts unavailable: the kernel log is not readable here (dmesg)"]
    assert second.notes == []


# ------------------------------------------------------------------------------------------- host


class FakeHostReader:
    """Host readings a test scripts: counters it sets by hand."""

    def __init__(self) -> None:
        self.reading = HostReading(
            cpu_count=64,
            cpu_total_seconds=1000.0,
            cpu_busy_seconds=400.0,
            cpu_iowait_seconds=10.0,
            load_1m=12.5,
            memory_used_bytes=100 << 30,
            memory_total_bytes=512 << 30,
            swap_used_bytes=0,
            swap_in_bytes_total=0.0,
            swap_out_bytes_total=0.0,
            disk_read_bytes_total=1e9,
            disk_write_bytes_total=2e9,
            network_rx_bytes_total=3e9,
            network_tx_bytes_total=4e9,
        )

    def __call__(self) -> HostReading:
        return HostReading(**{**self.reading.__dict__, "notes": list(self.reading.notes)})


def test_host_ratios_and_rates_come_from_counter_deltas() -> None:
    host = FakeHostReader()
    clock = FakeClock(T0)
    sampler = gpuless_sampler(clock, host=host)
    first = sampler.sample().host
    assert first is not None and first.cpu_count == 64 and first.load_1m == 12.5
    assert first.cpu_ratio is None and first.swap_in_bytes_per_second is None  # rates need two readings
    r = host.reading
    r.cpu_total_seconds += 2 * 64  # 2 s on 64 CPUs
    r.cpu_busy_seconds += 0.75 * 128
    r.cpu_iowait_seconds += 0.1 * 128
    r.swap_in_bytes_total += 4e8
    r.swap_out_bytes_total += 2e8
    r.disk_read_bytes_total += 1e9
    r.disk_write_bytes_total += 5e8
    r.network_rx_bytes_total += 2.5e9
    r.network_tx_bytes_total += 1e8
    clock.advance(2)
    second = sampler.sample().host
    assert second is not None
    assert second.cpu_ratio == pytest.approx(0.75) and second.cpu_iowait_ratio == pytest.approx(0.1)
    assert second.swap_in_bytes_per_second == pytest.approx(2e8)
    assert second.swap_out_bytes_per_second == pytest.approx(1e8)
    assert second.disk_read_bytes_per_second == pytest.approx(5e8)
    assert second.disk_write_bytes_per_second == pytest.approx(2.5e8)
    assert second.network_rx_bytes_per_second == pytest.approx(1.25e9)
    assert second.network_tx_bytes_per_second == pytest.approx(5e7)
    assert second.memory_used_bytes == 100 << 30 and second.memory_total_bytes == 512 << 30


def test_host_sample_without_a_counter_or_after_a_reset_is_none() -> None:
    before = HostReading(cpu_total_seconds=100, cpu_busy_seconds=50, disk_read_bytes_total=10e9)
    after = HostReading(cpu_total_seconds=200, cpu_busy_seconds=None, disk_read_bytes_total=1e9)
    sample = host_sample(before, after, 1.0)
    assert sample.cpu_ratio is None and sample.cpu_iowait_ratio is None
    assert sample.disk_read_bytes_per_second is None  # went down: a reset, not a negative rate
    assert sample.network_rx_bytes_per_second is None


def test_read_host_through_psutil_on_this_machine() -> None:
    reading = read_host()
    assert reading.notes == []
    assert reading.cpu_count and reading.cpu_count > 0
    assert reading.memory_total_bytes and reading.memory_used_bytes is not None
    assert reading.cpu_total_seconds and reading.cpu_busy_seconds is not None
    assert reading.cpu_busy_seconds <= reading.cpu_total_seconds
    assert reading.disk_read_bytes_total is not None and reading.network_rx_bytes_total is not None


def test_read_host_counts_physical_devices_and_survives_a_failing_part(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    disk = namedtuple("disk", "read_bytes write_bytes")
    nic = namedtuple("nic", "bytes_recv bytes_sent")
    disks = {"nvme0n1": disk(100, 10), "sda": disk(50, 5), "dm-0": disk(150, 15), "loop3": disk(7, 0)}
    nics = {"eth0": nic(1000, 500), "ib0": nic(20, 30), "lo": nic(9999, 9999), "veth12ab": nic(1000, 500)}
    monkeypatch.setattr(psutil, "disk_io_counters", lambda perdisk=False: disks)
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: nics)

    def no_swap() -> None:
        raise RuntimeError("couldn't find 'SwapTotal' in /proc/meminfo")

    monkeypatch.setattr(psutil, "swap_memory", no_swap)
    reading = read_host()
    assert (reading.disk_read_bytes_total, reading.disk_write_bytes_total) == (150, 15)
    assert (reading.network_rx_bytes_total, reading.network_tx_bytes_total) == (1020, 530)
    assert reading.swap_used_bytes is None and reading.swap_in_bytes_total is None
    assert reading.memory_total_bytes  # the other parts were still read
    assert reading.notes == ["host: reading swap failed: RuntimeError: couldn't find 'SwapTotal' in /proc/meminfo"]


# ------------------------------------------------------------------------------------------- steps


def test_steps_are_read_incrementally_and_a_partial_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "steps-0.jsonl"
    path.write_text("")
    tail = StepTail([path])
    notes: list[str] = []
    assert tail.poll(notes) == []
    line = step_line(0, 3)
    append(path, step_line(0, 1) + step_line(0, 2) + line[:40])
    assert [s.step for s in tail.poll(notes)] == [1, 2]
    assert tail.poll(notes) == []  # still half a line
    append(path, line[40:] + step_line(0, 4))
    steps = tail.poll(notes)
    assert [s.step for s in steps] == [3, 4]
    assert steps[0].compute_s == 1.3 and steps[0].rank == 0 and steps[0].mfu_catalog == 0.46
    assert notes == []


def test_steps_from_rank_files_that_appear_later_are_read_from_their_start(tmp_path: Path) -> None:
    rank0 = tmp_path / "steps-0.jsonl"
    rank0.write_text(step_line(0, 1) + step_line(0, 2) + '{"step": 3, "ti')  # history, ending mid-line
    tail = StepTail([str(tmp_path / "steps-{rank}.jsonl")])
    notes: list[str] = []
    assert tail.poll(notes) == []  # a file there from the start is followed from its end
    append(rank0, 'me_s": 1.5}\n' + step_line(0, 4))
    (tmp_path / "steps-1.jsonl").write_text(step_line(1, 1) + step_line(1, 2))
    steps = tail.poll(notes)
    assert [(s.rank, s.step) for s in steps] == [(0, 4), (1, 1), (1, 2)]
    assert notes == []  # the half line from before was skipped quietly, not parsed


def test_steps_history_is_read_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "steps-0.jsonl"
    path.write_text(step_line(0, 1) + step_line(0, 2))
    assert [s.step for s in StepTail([path], from_start=True).poll([])] == [1, 2]


def test_a_truncated_or_replaced_step_file_is_read_again_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "steps-0.jsonl"
    path.write_text("")
    tail = StepTail([path])
    notes: list[str] = []
    tail.poll(notes)
    append(path, step_line(0, 1) + step_line(0, 2))
    assert len(tail.poll(notes)) == 2
    path.write_text(step_line(0, 1))  # truncated (a restarted run that opened with "w")
    assert [s.step for s in tail.poll(notes)] == [1]
    assert notes == [f"steps: {path} was truncated or replaced; reading it again from the start"]
    rotated = tmp_path / "new.jsonl"
    rotated.write_text(step_line(0, 7) + step_line(0, 8) + step_line(0, 9))
    os.replace(rotated, path)  # a new file (new inode) at the same path, longer than the old one
    assert [s.step for s in tail.poll(notes)] == [7, 8, 9]
    path.unlink()
    assert tail.poll(notes) == [] and tail._files == {}


def test_a_restarted_runs_new_step_files_are_followed_from_their_start(tmp_path: Path) -> None:
    folder = tmp_path / "redline-steps"
    folder.mkdir()
    (folder / "rank-0.jsonl").write_text(step_line(0, 1))
    tail = StepTail([str(folder / "rank-{rank}.jsonl")])
    assert tail.poll([]) == []  # the first run, there before the monitor: followed from its end
    append(folder / "rank-0.jsonl", step_line(0, 2))
    assert [s.step for s in tail.poll([])] == [2]
    for path in folder.iterdir():  # the run is started again from scratch: its folder removed, written anew
        path.unlink()
    assert tail.poll([]) == []
    for rank in (0, 1):
        (folder / f"rank-{rank}.jsonl").write_text(step_line(rank, 1))
    assert [(s.rank, s.step) for s in tail.poll([])] == [(0, 1), (1, 1)]


def test_lines_that_are_not_step_records_are_skipped_with_one_note(tmp_path: Path) -> None:
    path = tmp_path / "steps-0.jsonl"
    path.write_text("")
    tail = StepTail([path])
    notes: list[str] = []
    tail.poll(notes)
    append(path, "garbage\n" + step_line(0, 1) + "[1, 2]\n\n" + '{"step": "x", "rank": 0}\n')
    append(path, step_line(0, 2, time_s=float("nan")) + step_line(0, 3))
    assert [s.step for s in tail.poll(notes)] == [1, 3]
    sampler = gpuless_sampler(FakeClock(T0), step_paths=[path])
    assert sampler.sample().notes == ["NVML started but found no GPUs to watch"]
    append(path, "more garbage\n")
    assert sampler.sample().notes == [f"steps: {path} has lines that are not step records; skipped"]
    append(path, "and more\n")
    assert sampler.sample().notes == []


def test_a_backlog_is_read_a_bounded_chunk_per_poll(tmp_path: Path) -> None:
    path = tmp_path / "steps-0.jsonl"
    path.write_text("".join(step_line(0, i) for i in range(1, 101)))
    tail = StepTail([path], from_start=True, max_bytes=4096)
    seen = []
    for _ in range(20):
        steps = tail.poll([])
        assert len(steps) <= 4096 // len(step_line(0, 1)) + 1
        seen += [s.step for s in steps]
    assert seen == list(range(1, 101))


# ------------------------------------------------------------------------------------------- cadence


class _SteppedEvent:
    """A threading.Event stand-in whose wait() moves a fake clock instead of sleeping."""

    def __init__(self, clock: FakeClock, stop_after: int, calls: list[float]) -> None:
        self.clock = clock
        self.stop_after = stop_after
        self.calls = calls
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return len(self.calls) >= self.stop_after

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.advance(timeout)
        return self.is_set()


class _SlowSampler:
    def __init__(self, clock: FakeClock, durations: list[float], calls: list[float]) -> None:
        self.clock = clock
        self.durations = durations
        self.calls = calls

    def sample(self) -> Sample:
        self.calls.append(self.clock.now)
        self.clock.advance(self.durations[(len(self.calls) - 1) % len(self.durations)])
        return Sample(time=self.clock.now)


def test_run_sampler_keeps_a_fixed_grid_whatever_each_sample_costs() -> None:
    clock = FakeClock(0.0)
    calls: list[float] = []
    sampler = _SlowSampler(clock, [0.3, 0.05, 0.6], calls)
    got: list[Sample] = []
    run_sampler(sampler, 1.0, got.append, _SteppedEvent(clock, 9, calls), monotonic=clock)  # type: ignore[arg-type]
    assert calls == pytest.approx([float(k) for k in range(9)])  # no drift from the time samples take
    assert len(got) == 9


def test_run_sampler_skips_the_slots_a_slow_sample_overran() -> None:
    clock = FakeClock(0.0)
    calls: list[float] = []
    sampler = _SlowSampler(clock, [0.1, 2.5, 0.1, 0.1], calls)
    run_sampler(sampler, 1.0, lambda s: None, _SteppedEvent(clock, 4, calls), monotonic=clock)  # type: ignore[arg-type]
    assert calls == pytest.approx([0.0, 1.0, 4.0, 5.0])  # no burst at 2 and 3 to catch up


def test_run_sampler_in_a_thread_stops_when_told() -> None:
    stop = threading.Event()
    got: list[Sample] = []
    sampler = gpuless_sampler(FakeClock(T0))
    thread = threading.Thread(target=run_sampler, args=(sampler, 0.01, got.append, stop))
    thread.start()
    while len(got) < 3:
        stop.wait(0.005)
    stop.set()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_run_sampler_refuses_a_nonpositive_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        run_sampler(gpuless_sampler(FakeClock(T0)), 0, lambda s: None, threading.Event())


# ------------------------------------------------------------------------------------------- bounded state


def _state_size(obj: Any, seen: set[int] | None = None, depth: int = 0) -> int:
    """How many items the sampler's own containers hold, through its objects (not the fakes it reads)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6 or isinstance(obj, FakeNvml | FakeHostReader | FakeClock):
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return len(obj) + sum(_state_size(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return len(obj) + sum(_state_size(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("redline"):
        return _state_size(vars(obj), seen, depth + 1)
    return 0


def test_a_long_run_keeps_its_state_bounded(tmp_path: Path) -> None:
    nvml = FakeNvml([h100_sxm(0, processes=[FakeProcess(4100, used_memory=1 << 30)])])
    clock = FakeClock(T0)
    path = tmp_path / "steps-0.jsonl"
    path.write_text("")
    host = FakeHostReader()
    sampler = make_sampler(nvml, clock, host=host, step_paths=[path], kernel_log=lambda: "", xid_interval_s=5)
    sampler.sample()
    sizes = {}
    for i in range(1, 2001):
        for gpu in nvml.gpus:
            gpu.run_for(1.0)
        host.reading.notes = [f"host: a problem that changes every time ({i})"]  # new notes, forever
        append(path, step_line(0, i))
        clock.advance(1)
        sample = sampler.sample()
        assert len(sample.steps) == 1
        if i in (1000, 2000):
            sizes[i] = _state_size(sampler)
    assert sizes[2000] == sizes[1000]
    assert len(sampler._once._seen) == 512  # the notes already given are capped: the oldest are forgotten


# ------------------------------------------------------------------------------------------- traces


def _last(samples: list[Sample]) -> Sample:
    return samples[-1]


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_trace_plays_what_it_says(name: str, tmp_path: Path) -> None:
    # long enough for every fault to have set in (the loss and return of NVML take 30 ticks)
    trace = scenario(name, root=tmp_path, ticks=40 if name == "nvml_lost" else 22)
    samples = trace.run()
    assert len(samples) == trace.ticks
    end = _last(samples)
    gpus, host = end.gpus, end.host
    assert host is not None and len(gpus) == 8
    steps = [s for sample in samples for s in sample.steps]
    assert {s.rank for s in steps} == set(range(8))
    if name != "nvml_lost":
        # the first sample comes before the first step is written: a run still to come, not worth a note
        assert [note for sample in samples for note in sample.notes] == [], name
        assert all(g.power_watts and g.energy_joules_total for g in gpus)
    busy = [g.utilization_ratio or 0 for g in gpus]
    if name == "healthy":
        assert min(busy) >= 0.95 and all(g.clock_event_reasons == [] for g in gpus)
        assert all(g.nvlink_tx_bytes_per_second and g.nvlink_tx_bytes_per_second > 100e9 for g in gpus)
    elif name == "throttling":
        for i in range(8):
            reasons = set(gpus[i].clock_event_reasons or [])
            assert ("sw_thermal_slowdown" in reasons) == (i in trace.affected_gpus)
        assert all(gpus[i].sm_clock_hertz < 0.85 * gpus[i].sm_clock_max_hertz for i in trace.affected_gpus)
        assert all(gpus[i].temperature_celsius >= 85 for i in trace.affected_gpus)
    elif name == "power_cap":
        assert all(g.power_limit_watts == 500 and g.power_watts >= 495 for g in gpus)
        assert all(g.clock_event_reasons == ["sw_power_cap"] for g in gpus)
    elif name == "straggler":
        assert min(range(8), key=lambda i: busy[i]) == 6
        data = {rank: max(s.data_s for s in steps if s.rank == rank) for rank in range(8)}
        assert max(data, key=data.get) == 6  # type: ignore[arg-type]
        assert min(s.comm_s for s in steps if s.rank != 6) > 0.5
    elif name == "input_bound":
        assert max(busy) <= 0.55 and host.cpu_ratio > 0.9
        assert all(s.data_s > 0.5 * s.time_s for s in steps)
    elif name == "memory_full":
        assert all(g.memory_used_bytes / g.memory_total_bytes > 0.96 for g in gpus)
    elif name == "foreign_process":
        holders = [g.index for g in gpus if any(p.pid == FOREIGN_PID for p in g.processes)]
        assert holders == [4]
        foreign = next(p for p in gpus[4].processes if p.pid == FOREIGN_PID)
        assert foreign.name == "python3" and foreign.user == user_name(1001) and foreign.used_memory_bytes == 22 << 30
        assert {p.pid for p in gpus[0].processes} == {trace.job_pids[0]}
    elif name == "pcie_downgrade":
        assert gpus[3].pcie_link_width == 8 and gpus[3].pcie_link_width_max == 16
        assert gpus[6].pcie_link_generation == 3 and gpus[6].pcie_link_generation_max == 5
        assert all(g.pcie_link_width == 16 and g.pcie_link_generation == 5 for g in gpus if g.index not in (3, 6))
        assert gpus[3].pcie_replay_total > 0
    elif name == "swapping":
        assert host.swap_in_bytes_per_second > 50e6 and host.swap_out_bytes_per_second > 50e6
        assert host.swap_used_bytes > 0 and host.cpu_iowait_ratio > 0.1
        assert samples[0].host.swap_in_bytes_per_second is None
    elif name == "nvml_lost":
        lost = [all(g.lost for g in s.gpus) for s in samples]
        assert lost[:10] == [False] * 10 and all(lost[10:30]) and not any(lost[30:])
        assert samples[10].notes[0].startswith("every GPU answers GPU_IS_LOST")
        assert any(n.startswith("NVML is back") for n in samples[30].notes)
        assert gpus[3].xid_total == 1  # the Xid 79 the driver logged for it
        assert gpus[0].energy_joules_total < 1e5  # the reloaded driver's counter started again
        assert not any(s.steps for s in samples[11:24])


def test_a_trace_moves_forward_only_and_knows_its_names() -> None:
    trace = scenario("healthy", ticks=5)
    trace.at(3)
    assert trace.tick == 3 and trace.clock() == pytest.approx(trace.clock.now)
    with pytest.raises(ValueError):
        trace.at(1)
    with pytest.raises(KeyError, match="no scenario"):
        scenario("overclocked")


def test_a_steps_pattern_that_matches_nothing_yet_is_watched_without_a_note(tmp_path) -> None:
    # a run started after the monitor: no note while it is to come (the monitor says where it watches, once, at
    # start: tests/monitor/test_monitor_steps.py), and its files followed from their first line when they come
    sampler = Sampler(nvml=None, host=None, kernel_log=None, step_paths=[str(tmp_path / "metrics-{rank}.jsonl")])
    assert [note for _ in range(3) for note in sampler.sample().notes if note.startswith("steps")] == []
    assert sampler.steps.patterns == [f"{tmp_path}/metrics-*.jsonl"]
    (tmp_path / "metrics-1.jsonl").write_text(step_line(1, 1) + step_line(1, 2))
    sample = sampler.sample()
    assert [(s.rank, s.step) for s in sample.steps] == [(1, 1), (1, 2)]
