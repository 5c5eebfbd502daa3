"""Take a snapshot of this server: GPUs through NVML, the rest through /sys and /proc.

The one entry point the CLI and the other parts call. Each section is probed on its own and a failure in
one (a bug, an unexpected file) becomes a note in ``probe_errors`` instead of losing the whole snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from redline.errors import one_line
from redline.hw.host import probe_host
from redline.hw.kernel_log import count_xids, count_xids_by_device, read_kernel_log
from redline.hw.network import probe_network
from redline.hw.nvml.probe import probe_gpus
from redline.hw.snapshot import GpuSection, HostInfo, NetworkInfo, Snapshot, SoftwareInfo, StorageInfo
from redline.hw.software import probe_software
from redline.hw.storage import probe_storage
from redline.hw.sysfs import SysFs

if TYPE_CHECKING:
    from redline.hw.cpu_busy import CpuWatch

T = TypeVar("T")

# the least a CPU-use sample lasts (`top` refreshes every 3 s, `mpstat 1` every second): long enough for a
# 100 Hz CPU clock to count in 2% steps, short enough that `redline doctor` answers at once
CPU_SAMPLE_S = 0.5


def take_snapshot(
    *,
    fs: SysFs | None = None,
    nvml: Any | None = None,
    data_paths: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    kernel_log: Callable[[], str | None] = read_kernel_log,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    cpu_sample_s: float = 0.0,
) -> Snapshot:
    """Probe everything. ``cpu_sample_s`` > 0 also samples how busy other processes keep the CPUs, over the
    probe and at least that long (``host.cpu_busy``: the doctor and `redline probe` ask for it, the rest
    need not wait). Other arguments exist for tests (a fake /sys root, a fake NVML, a fixed environment, a
    canned kernel log); the product path uses the real ones."""
    fs = fs or SysFs("/")
    errors: list[str] = []

    def section(name: str, probe: Callable[[], T], empty: Callable[[], T]) -> T:
        try:
            return probe()
        except Exception as exc:  # a probe bug must not cost the user the rest of the snapshot
            errors.append(f"{name} probe failed: {one_line(exc)}")
            return empty()

    watch = section("cpu use", _cpu_watch, lambda: None) if cpu_sample_s > 0 else None
    gpu = section("gpu", lambda: probe_gpus(nvml, errors, fs), GpuSection)
    snapshot = Snapshot(
        taken_at=datetime.now(UTC).isoformat(timespec="seconds"),
        gpu=gpu,
        host=section("host", lambda: probe_host(fs, statvfs), HostInfo),
        storage=section("storage", lambda: probe_storage(fs, data_paths, statvfs), StorageInfo),
        network=section("network", lambda: probe_network(fs), NetworkInfo),
        software=section("software", lambda: probe_software(fs, environ), SoftwareInfo),
    )
    if gpu.gpus:
        _numa_from_sysfs(gpu, fs)
        log = kernel_log()
        if log is not None:
            gpu.xid_counts = count_xids(log)
            gpu.xid_by_device = count_xids_by_device(log)
    if watch is not None:
        snapshot.host.cpu_busy = section(
            "cpu use", lambda: watch.stop(snapshot.host, at_least_s=cpu_sample_s), lambda: None
        )
    snapshot.probe_errors = errors + fs.errors
    return snapshot


def _cpu_watch() -> CpuWatch:
    from redline.hw.cpu_busy import CpuWatch

    return CpuWatch()


def _numa_from_sysfs(gpu: GpuSection, fs: SysFs) -> None:
    """The CPU-side NUMA node of each GPU's PCIe slot, as /sys reports it.

    NVML's nvmlDeviceGetNumaNodeId answers only where GPU memory is itself a NUMA node (Grace Hopper),
    and then names that memory node, which has no CPUs. Pinning and NIC placement need the slot's node.
    """
    for g in gpu.gpus:
        if g.pci_bus_id:
            node = fs.read_int(f"/sys/bus/pci/devices/{g.pci_bus_id}/numa_node")
            if node is not None and node >= 0:
                g.numa_node = node
