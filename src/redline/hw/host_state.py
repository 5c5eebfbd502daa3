"""The host's changing state, read again and again: CPU time, load, memory, swap, disk and network bytes.

``read_host`` reads it through psutil, each part on its own, into a ``HostReading`` of gauges and
cumulative counters; ``host_sample`` turns two readings into a ``HostSample`` of ratios and rates, as
`redline monitor` records them. The static facts of the host (CPU model, NUMA, cgroup limits) are read once
by ``host.probe_host``; this module is for what moves while a job runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redline.errors import one_line
from redline.hw.sample import HostSample


@dataclass
class HostReading:
    """What the host says at one instant: gauges, and cumulative counters that rates are taken from.

    A host reader returns one per call (``read_host`` with psutil; tests pass their own).
    CPU times are seconds summed over all cores since boot; byte counters are since boot too. ``notes``:
    what could not be read, in words.
    """

    cpu_count: int | None = None
    cpu_total_seconds: float | None = None
    cpu_busy_seconds: float | None = None  # everything but idle and iowait, as psutil.cpu_percent counts
    cpu_iowait_seconds: float | None = None  # Linux only
    load_1m: float | None = None
    memory_used_bytes: int | None = None  # total - available: what no cache can give back
    memory_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    swap_in_bytes_total: float | None = None
    swap_out_bytes_total: float | None = None
    disk_read_bytes_total: float | None = None
    disk_write_bytes_total: float | None = None
    network_rx_bytes_total: float | None = None
    network_tx_bytes_total: float | None = None
    notes: list[str] = field(default_factory=list)


HostReader = Callable[[], HostReading]

# Block devices whose I/O is already counted on the physical disks beneath them (device-mapper, md RAID)
# or is not disk I/O at all (loop, RAM disks).
_VIRTUAL_DISKS = ("loop", "ram", "zram", "dm-", "md", "nbd", "sr")
# Network interfaces that carry a copy of traffic already counted on a physical NIC, or none of it.
_VIRTUAL_NICS = ("lo", "veth", "docker", "br-", "virbr", "cni", "flannel", "cali", "tunl", "vxlan")

# Rates and ratios of HostSample, each from a HostReading counter.
_HOST_RATES = (
    ("swap_in_bytes_per_second", "swap_in_bytes_total"),
    ("swap_out_bytes_per_second", "swap_out_bytes_total"),
    ("disk_read_bytes_per_second", "disk_read_bytes_total"),
    ("disk_write_bytes_per_second", "disk_write_bytes_total"),
    ("network_rx_bytes_per_second", "network_rx_bytes_total"),
    ("network_tx_bytes_per_second", "network_tx_bytes_total"),
)


def read_host() -> HostReading:
    """The host through psutil (the product's host reader); each part on its own, so one unreadable
    /proc file costs only its fields."""
    reading = HostReading()
    try:
        import psutil
    except ImportError:
        reading.notes.append("host: psutil is not installed; no host figures")
        return reading
    for what, read in (
        ("CPU", _read_cpu),
        ("memory", _read_memory),
        ("swap", _read_swap),
        ("disks", _read_disks),
        ("network", _read_network),
    ):
        try:
            read(psutil, reading)
        except Exception as exc:  # psutil raises OSError, RuntimeError, even AttributeError on odd kernels
            reading.notes.append(f"host: reading {what} failed: {one_line(exc)}")
    return reading


def _read_cpu(psutil: Any, reading: HostReading) -> None:
    reading.cpu_count = psutil.cpu_count()
    times = psutil.cpu_times()
    # psutil's own accounting (cpu_percent): guest time is already inside user/nice, so leave it out of
    # the total; busy is what is neither idle nor waiting for I/O
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    iowait = getattr(times, "iowait", None)
    reading.cpu_total_seconds = total
    reading.cpu_busy_seconds = total - times.idle - (iowait or 0.0)
    reading.cpu_iowait_seconds = iowait
    reading.load_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _read_memory(psutil: Any, reading: HostReading) -> None:
    memory = psutil.virtual_memory()
    reading.memory_total_bytes = memory.total
    reading.memory_used_bytes = memory.total - memory.available


def _read_swap(psutil: Any, reading: HostReading) -> None:
    swap = psutil.swap_memory()
    reading.swap_used_bytes = swap.used
    reading.swap_in_bytes_total = swap.sin  # bytes swapped in since boot (0 where the OS does not say)
    reading.swap_out_bytes_total = swap.sout


def _read_disks(psutil: Any, reading: HostReading) -> None:
    disks = psutil.disk_io_counters(perdisk=True) or {}
    physical = [c for name, c in disks.items() if not name.startswith(_VIRTUAL_DISKS)]
    reading.disk_read_bytes_total = sum(c.read_bytes for c in physical)
    reading.disk_write_bytes_total = sum(c.write_bytes for c in physical)


def _read_network(psutil: Any, reading: HostReading) -> None:
    nics = psutil.net_io_counters(pernic=True) or {}
    physical = [c for name, c in nics.items() if not name.startswith(_VIRTUAL_NICS)]
    reading.network_rx_bytes_total = sum(c.bytes_recv for c in physical)
    reading.network_tx_bytes_total = sum(c.bytes_sent for c in physical)


def host_sample(previous: HostReading | None, current: HostReading, elapsed_s: float | None) -> HostSample:
    """A HostSample from two readings ``elapsed_s`` apart (rates and CPU ratios need both: None without)."""
    sample = HostSample(
        cpu_count=current.cpu_count,
        load_1m=current.load_1m,
        memory_used_bytes=current.memory_used_bytes,
        memory_total_bytes=current.memory_total_bytes,
        swap_used_bytes=current.swap_used_bytes,
    )
    if previous is None:
        return sample
    total = _delta(previous.cpu_total_seconds, current.cpu_total_seconds)
    if total:
        sample.cpu_ratio = _ratio(_delta(previous.cpu_busy_seconds, current.cpu_busy_seconds), total)
        sample.cpu_iowait_ratio = _ratio(_delta(previous.cpu_iowait_seconds, current.cpu_iowait_seconds), total)
    if elapsed_s and elapsed_s > 0:
        for rate, counter in _HOST_RATES:
            increase = _delta(getattr(previous, counter), getattr(current, counter))
            setattr(sample, rate, None if increase is None else increase / elapsed_s)
    return sample


def _delta(before: float | None, after: float | None) -> float | None:
    """How much a counter grew; None where either reading is missing or it went down (a reset)."""
    if before is None or after is None or after < before:
        return None
    return after - before


def _ratio(part: float | None, total: float) -> float | None:
    return None if part is None else min(max(part / total, 0.0), 1.0)


def process_state(pid: int) -> str | None:
    """What a process is doing, as psutil names it ("running", "sleeping", "disk-sleep", "zombie"...); None
    where it is gone or cannot be read."""
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def process_rss_bytes() -> int:
    """This process's resident memory now (what a CPU backend's peak memory is sampled from)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
