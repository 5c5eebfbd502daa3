"""What the live readers give at one instant: a ``GpuSample`` per GPU (with the processes on it) and a
``HostSample`` of the host.

Plain data, JSON-ready; the monitor's ``Sample`` (redline.monitor.sample) carries them, the bench's GPU
sampler reads GpuSamples while a measurement runs. Units follow Prometheus's base-unit conventions and are
in the field names: bytes, seconds, watts, joules, hertz, celsius, and ``_ratio`` for a fraction in
[0, 1]. ``_total`` fields are counters that only grow (until the driver or host restarts). ``None`` always means
"not available here", never zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GpuProcess:
    pid: int
    name: str | None = None  # from /proc; None where it is not readable (another container, gone)
    user: str | None = None
    used_memory_bytes: int | None = None
    kind: str = "compute"  # compute | graphics


@dataclass
class GpuSample:
    index: int
    uuid: str | None = None
    name: str | None = None
    lost: bool = False  # NVML answered GPU_IS_LOST (Xid 79) or the GPU vanished: everything else is None
    utilization_ratio: float | None = None  # a kernel was running (NVML's "GPU utilisation")
    memory_bandwidth_ratio: float | None = None  # device memory was being read or written
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    memory_clock_hertz: float | None = None
    memory_clock_max_hertz: float | None = None
    clock_event_reasons: list[str] | None = None  # e.g. ["sw_power_cap", "hw_thermal_slowdown"]; [] = none set
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None
    temperature_celsius: float | None = None
    temperature_slowdown_celsius: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_link_generation: int | None = None
    pcie_link_generation_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    pcie_replay_total: int | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    xid_total: int | None = None  # Xid events for this GPU in the kernel log
    sm_activity_ratio: float | None = None  # Hopper+ GPM: fraction of SM cycles busy
    tensor_activity_ratio: float | None = None  # Hopper+ GPM: tensor-core pipe activity
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class HostSample:
    cpu_ratio: float | None = None  # all cores together
    cpu_count: int | None = None
    cpu_iowait_ratio: float | None = None
    load_1m: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    swap_in_bytes_per_second: float | None = None
    swap_out_bytes_per_second: float | None = None
    disk_read_bytes_per_second: float | None = None
    disk_write_bytes_per_second: float | None = None
    network_rx_bytes_per_second: float | None = None
    network_tx_bytes_per_second: float | None = None
