"""The GPU sampler reads clocks and throttle reasons through the NVML adapter while work runs."""

from __future__ import annotations

import time

from fakes.fake_nvml import HW_THERMAL, SW_POWER_CAP, eight_gpu_server
from redline.bench.sampler import ClockStateReader, GpuSampler
from redline.hw.nvml.live import GpuStateReader
from redline.hw.sysfs import SysFs


def test_reader_reads_the_fast_changing_state():
    nvml = eight_gpu_server(faults={1: {"clock_event_reasons": SW_POWER_CAP | HW_THERMAL}})
    reader = ClockStateReader.open([0, 1], nvml=nvml)
    assert reader is not None
    samples = {s["index"]: s for s in reader.read()}
    reader.close()
    assert nvml.active_inits == 0
    assert samples[0]["sm_mhz"] and samples[0]["power_w"] and samples[0]["temperature_c"] is not None
    assert samples[1]["reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]


def test_sampler_summarises_and_is_a_noop_without_nvml(monkeypatch):
    nvml = eight_gpu_server(faults={0: {"clock_event_reasons": SW_POWER_CAP}})
    reader = GpuStateReader(nvml, SysFs("/"))
    monkeypatch.setattr(ClockStateReader, "open", classmethod(lambda cls, indices: cls(reader)))
    monkeypatch.setattr(
        ClockStateReader,
        "read",
        lambda self: [{"index": 0, "sm_mhz": 1755, "power_w": 690.0, "temperature_c": 71, "reasons": ["sw_power_cap"]}],
    )
    monkeypatch.setattr(ClockStateReader, "close", lambda self: None)
    with GpuSampler([0], interval_s=0.01) as sampler:
        time.sleep(0.05)
    summary = sampler.summary()["0"]
    assert summary["samples"] >= 1
    assert summary["sm_mhz_median"] == 1755 and summary["clock_event_reasons"] == ["sw_power_cap"]


def test_sampler_without_a_driver_records_nothing():
    # this machine has no NVIDIA driver: the real product path must not raise
    with GpuSampler([0]) as sampler:
        pass
    assert sampler.summary() == {}
