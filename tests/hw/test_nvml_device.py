"""The Device model over the fake NVML: each method answers in base units, absence is None, a lost GPU raises."""

from __future__ import annotations

import dataclasses

import pynvml
import pytest

from fakes.fake_nvml import HW_THERMAL, SW_POWER_CAP, FakeGpu, FakeNvml, MiB, h100_sxm, rtx_4090
from redline.hw.nvml.device import Device, Memory, Utilization
from redline.hw.nvml.query import GpuLost, LiveQuery, NvmlGone, Query
from redline.hw.sample import GpuSample
from redline.hw.sysfs import SysFs


def _device(gpu: FakeGpu, query: type[Query] = Query) -> tuple[Device, list[str], FakeNvml]:
    """A Device over one fake GPU, with the notes its query writes (the fake NVML holds nothing to shut down)."""
    nvml = FakeNvml([gpu])
    nvml.nvmlInit()
    notes: list[str] = []
    if query is LiveQuery:
        q: Query = LiveQuery(nvml, notes, "GPU 0", SysFs("/"))
    else:
        q = Query(nvml, notes, "GPU 0", SysFs("/"), health={})
    return Device(q, nvml.nvmlDeviceGetHandleByIndex(0)), notes, nvml


def test_quantities_are_in_base_units() -> None:
    gpu = h100_sxm(
        sm_clock_mhz=1755,
        power_draw_mw=690_500,
        temperature_c=71,
        memory_used_mib=1024,
        utilization_pct=97,
        memory_utilization_pct=40,
        clock_event_reasons=SW_POWER_CAP | HW_THERMAL,
        energy_mj=3_125_000,
        pcie_tx_kbps=2,
    )
    device, notes, _ = _device(gpu)
    assert device.sm_clock_hertz() == 1755e6
    assert device.sm_clock_max_hertz() == 1980e6
    assert device.memory_clock_hertz() == 2619e6
    assert device.power_watts() == 690.5
    assert device.power_limit_watts() == 700.0
    assert device.power_max_limit_watts() == 700.0
    assert device.energy_joules_total() == 3125.0
    assert device.temperature_celsius() == 71.0
    assert device.temperature_slowdown_celsius() == 90.0
    assert device.memory() == Memory(used_bytes=1024 * MiB, total_bytes=81559 * MiB)
    assert device.utilization() == Utilization(kernel_ratio=0.97, memory_bandwidth_ratio=0.40)
    assert device.clock_event_reasons() == ["sw_power_cap", "hw_thermal_slowdown"]
    assert device.pcie_throughput_bytes_per_second() == (2048, 0)
    assert device.ecc_corrected_total() == 0
    assert device.nvlink_active(0) is True
    assert device.uuid() == gpu.uuid
    assert device.compute_capability() == "9.0"
    assert notes == []


def test_an_unsupported_quantity_is_none_and_no_note() -> None:
    # a GeForce has no ECC and no NVLink; a board may hide its power draw
    device, notes, _ = _device(rtx_4090(unsupported={"nvmlDeviceGetPowerUsage"}))
    assert device.power_watts() is None
    assert device.ecc_corrected_total() is None
    assert device.ecc_uncorrected_total(volatile=False) is None
    assert device.nvlink_active(0) is None
    assert device.multiprocessor_count() is None
    assert device.temperature_celsius() is not None  # the rest still answers
    assert notes == []


def test_an_unhealthy_answer_is_none_with_a_note_and_a_health_error() -> None:
    device, notes, _ = _device(h100_sxm(errors={"nvmlDeviceGetTemperature": pynvml.NVMLError_Unknown()}))
    assert device.temperature_celsius() is None
    assert device.q.health == {"nvmlDeviceGetTemperature": "UNKNOWN"}
    assert len(notes) == 1 and notes[0].startswith("GPU 0: nvmlDeviceGetTemperature")


def test_a_lost_gpu_raises_on_any_quantity() -> None:
    device, _, _ = _device(h100_sxm(lost=True))
    for read in (device.power_watts, device.sm_clock_hertz, device.memory, device.clock_event_reasons):
        with pytest.raises(GpuLost):
            read()
    assert device.q.health["nvmlDeviceGetPowerUsage"] == "GPU_IS_LOST"  # recorded for the doctor


def test_through_a_live_query_nvml_going_away_raises_and_unsupported_calls_are_not_repeated() -> None:
    device, _, nvml = _device(rtx_4090(), query=LiveQuery)
    assert device.ecc_corrected_total() is None
    assert device.ecc_corrected_total() is None
    assert nvml.calls.count("nvmlDeviceGetTotalEccErrors") == 1
    nvml.unload()
    with pytest.raises(NvmlGone):
        device.power_watts()


def test_a_sample_field_and_the_device_method_that_reads_it_share_a_name() -> None:
    # one vocabulary: the live reader fills GpuSample fields from Device methods of the same name
    methods = {name for name in dir(Device) if not name.startswith("_")}
    fields = {f.name for f in dataclasses.fields(GpuSample)}
    assert {
        "sm_clock_hertz",
        "memory_clock_max_hertz",
        "power_watts",
        "power_limit_watts",
        "energy_joules_total",
        "temperature_celsius",
        "temperature_slowdown_celsius",
        "pcie_link_width",
        "ecc_uncorrected_total",
        "clock_event_reasons",
    } <= methods & fields
