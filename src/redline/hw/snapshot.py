"""The snapshot: everything the probe learned about a server, as plain, versioned, JSON-ready data.

Every field that could not be read is ``None`` ("not available"), never an exception: a GeForce card
has no ECC, a container has no cpufreq, a laptop has no InfiniBand. Units are in the field names.
Everything above ``hw/`` (doctor rules, reports, the planner) reads these dataclasses, never NVML or /sys.

``SCHEMA_VERSION`` goes up whenever a field changes meaning or is removed; adding a field with a default
does not need a bump. ``load_snapshot`` refuses a snapshot from a newer schema than it knows.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.errors import BadInput

SCHEMA_VERSION = 1
# the first key of every snapshot file, so a later run knows a file is a snapshot it may replace
SNAPSHOT_MARKER = '"schema_version"'


class SnapshotError(BadInput):
    """A snapshot file that cannot be read or does not match the schema."""


# --------------------------------------------------------------------------------------------- GPUs


@dataclass
class GpuClocks:
    sm_mhz: int | None = None
    sm_max_mhz: int | None = None
    memory_mhz: int | None = None
    memory_max_mhz: int | None = None
    # clocks set by `nvidia-smi -ac` (application clocks); None where the GPU does not support them
    applications_sm_mhz: int | None = None


@dataclass
class GpuPower:
    draw_w: float | None = None
    enforced_limit_w: float | None = None
    default_limit_w: float | None = None
    max_limit_w: float | None = None


@dataclass
class GpuThermal:
    temperature_c: int | None = None
    slowdown_c: int | None = None
    shutdown_c: int | None = None


@dataclass
class PcieLink:
    gen_current: int | None = None
    # the generation this GPU can reach in this slot (min of GPU and slot)
    gen_max: int | None = None
    # the generation the GPU itself supports, whatever slot it sits in
    gen_gpu_max: int | None = None
    width_current: int | None = None
    width_max: int | None = None
    replay_count: int | None = None


@dataclass
class GpuEcc:
    enabled: bool | None = None
    # errors since the last driver load
    volatile_corrected: int | None = None
    volatile_uncorrected: int | None = None
    # errors over the GPU's lifetime
    aggregate_corrected: int | None = None
    aggregate_uncorrected: int | None = None


@dataclass
class GpuRetirement:
    """Memory rows the GPU took out of service (row remapping on A100+, page retirement before)."""

    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None


@dataclass
class NvLink:
    link: int
    active: bool
    # PCI bus id of whatever sits at the other end (a GPU or an NVSwitch)
    peer_pci_bus_id: str | None = None


@dataclass
class GpuProcess:
    pid: int
    name: str | None = None
    used_memory_bytes: int | None = None
    kind: str = "compute"  # compute | graphics
    # owner, from /proc/<pid>/status; None when the pid is in another PID namespace (another container)
    uid: int | None = None


@dataclass
class MigDevice:
    """A MIG instance of a GPU in MIG mode: a device of its own to CUDA, named by its UUID in
    CUDA_VISIBLE_DEVICES (a CUDA process sees one MIG instance at most)."""

    slot: int  # its place among the GPU's instances (nvmlDeviceGetMigDeviceHandleByIndex)
    uuid: str | None = None  # "MIG-..."
    name: str | None = None  # "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    multiprocessor_count: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    processes: list[GpuProcess] | None = None


@dataclass
class Gpu:
    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    # set when NVML answered GPU_IS_LOST for this device: the GPU fell off the bus
    lost: bool = False
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    compute_capability: str | None = None  # "9.0"
    multiprocessor_count: int | None = None  # NVML answers for MIG instances only: usually None
    persistence_mode: bool | None = None
    compute_mode: str | None = None  # default | exclusive_thread | prohibited | exclusive_process
    mig_mode: bool | None = None
    mig_devices: list[MigDevice] = field(default_factory=list)  # its instances, in MIG mode
    virtualization_mode: str | None = None  # none | passthrough | vgpu | host_vgpu | host_vsga
    utilization_ratio: float | None = None  # 0-1, share of the last sample period a kernel ran
    clocks: GpuClocks = field(default_factory=GpuClocks)
    # active clock-event (throttle) reasons by name, e.g. ["sw_power_cap"]; None if NVML cannot say
    clock_event_reasons: list[str] | None = None
    power: GpuPower = field(default_factory=GpuPower)
    thermal: GpuThermal = field(default_factory=GpuThermal)
    pcie: PcieLink = field(default_factory=PcieLink)
    ecc: GpuEcc = field(default_factory=GpuEcc)
    retirement: GpuRetirement = field(default_factory=GpuRetirement)
    nvlinks: list[NvLink] | None = None
    # NVSwitch fabric registration (Hopper+): "completed", "in_progress", "not_started", "not_supported"
    fabric_state: str | None = None
    # once the state is "completed": "success", or the NVML error name the fabric manager reported
    fabric_status: str | None = None
    # the CPU NUMA node nearest the GPU's PCIe slot (from /sys; NVML's answer only where sysfs has none)
    numa_node: int | None = None
    cpu_affinity: list[int] | None = None
    processes: list[GpuProcess] | None = None
    # NVML calls that failed with an error that says something about the GPU's health (not "not
    # supported"): NVML function name -> error name, e.g. {"nvmlDeviceGetEccMode": "CORRUPTED_INFOROM"}
    health_errors: dict[str, str] = field(default_factory=dict)


@dataclass
class GpuSection:
    """What NVML says. ``error`` is set when NVML itself could not start (no driver, version mismatch)."""

    nvml_available: bool = False
    error: str | None = None
    # why NVML could not start, for rules: "library_not_found", "driver_not_loaded",
    # "driver_mismatch" (kernel module and library differ), "no_permission", "other"
    error_code: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.4": the newest CUDA the driver supports
    nvml_version: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    # p2p[i][j]: P2P read status from GPU i to GPU j, NVML's nvmlGpuP2PStatus: "ok",
    # "chipset_not_supported", "gpu_not_supported" (the GPU model has no P2P), "topology_not_supported"
    # (NVML: IOH_TOPOLOGY_NOT_SUPPORTED), "disabled_by_regkey", "not_supported", "unknown"; diagonal "self"
    p2p: list[list[str]] | None = None
    # topology[i][j]: nearest common ancestor as nvidia-smi topo -m names it: "SELF", "PIX", "PXB",
    # "PHB", "NODE", "SYS" (NV links are in Gpu.nvlinks), or "unknown" where NVML cannot say
    topology: list[list[str]] | None = None
    # NVRM Xid codes seen in the kernel log ring buffer, with counts; None if the log could not be read
    xid_counts: dict[str, int] | None = None
    # the same per GPU: PCI address as the Xid line names it ("0000:3b:00") -> code -> count
    xid_by_device: dict[str, dict[str, int]] | None = None


# --------------------------------------------------------------------------------------------- host


@dataclass
class NumaNode:
    node: int
    cpus: list[int]
    memory_total_bytes: int | None = None


# other processes taking this share of the cores this process may use make it a busy host: a job's threads
# queue behind theirs (OpenMP's spinning barriers worst of all) and measurements taken then understate the machine
BUSY_RATIO = 0.25


@dataclass
class BusyProcess:
    """A process of another user or program that kept CPUs busy while we sampled; ``name`` is its short name
    (the kernel's comm, as `ps -o comm` shows it), never its command line."""

    pid: int
    name: str | None = None
    user: str | None = None
    cpu_cores: float = 0.0  # CPU-seconds it used per second of the sample


@dataclass
class CpuBusy:
    """How busy other processes kept the CPUs this process may run on, over a short sample.

    ``others_cores``: CPU-seconds per second spent on those CPUs by every process outside our own process tree
    (user, nice and system time; a whole machine's CPUs are several cores' worth). ``usable_cores``: what this
    process may use of them (its cgroup quota may be less than its CPUs). ``top``: the busiest other processes.
    """

    sample_s: float
    cpus: int
    usable_cores: float
    others_cores: float
    load_1m: float | None = None
    top: list[BusyProcess] = field(default_factory=list)

    @property
    def taken_ratio(self) -> float:
        """The share of our usable cores other processes took: their use beyond the CPUs we would not use
        anyway (a quota of 2 on 64 CPUs leaves 62 for others before they cost us anything)."""
        spare = max(0.0, self.cpus - self.usable_cores)
        return min(1.0, max(0.0, (self.others_cores - spare) / self.usable_cores)) if self.usable_cores else 0.0

    @property
    def busy(self) -> bool:
        return self.taken_ratio >= BUSY_RATIO

    def describe(self) -> str:
        """'other processes kept 1.6 of 2 CPUs busy (load 6.1; python3 (alice) 1.0, ...)', for a note."""
        top = ", ".join(f"{p.name or p.pid}{f' ({p.user})' if p.user else ''} {p.cpu_cores:.1f}" for p in self.top[:3])
        load = f"load {self.load_1m:.1f}" if self.load_1m is not None else ""
        details = "; ".join(part for part in (load, top) if part)
        return f"other processes kept {min(self.others_cores, self.cpus):.1f} of {self.cpus} CPUs busy" + (
            f" ({details})" if details else ""
        )


@dataclass
class HostInfo:
    hostname: str | None = None
    kernel: str | None = None
    os_name: str | None = None
    cpu_model: str | None = None
    cpu_logical_cores: int | None = None
    cpu_physical_cores: int | None = None
    # scaling governor -> how many CPUs use it; None where cpufreq is absent (VMs, containers)
    cpu_governors: dict[str, int] | None = None
    cpu_arch: str | None = None  # platform.machine(): x86_64, aarch64 (Grace has no "model name")
    # running under a hypervisor (the "hypervisor" CPU flag): a cloud VM
    hypervisor: bool | None = None
    # CPUs this process may run on (sched_getaffinity)
    process_cpu_count: int | None = None
    process_cpus: list[int] | None = None
    # cgroup limits: None means unlimited or not in a cgroup that limits
    cgroup_cpu_limit_cores: float | None = None
    cgroup_memory_limit_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    swappiness: int | None = None
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None
    numa_nodes: list[NumaNode] | None = None
    numa_balancing: bool | None = None
    kernel_cmdline: str | None = None
    # DMA translation of the IOMMU groups (/sys/kernel/iommu_groups/*/type): "off" (no groups),
    # "passthrough" (all identity), "translated" (any DMA / DMA-FQ group)
    iommu_mode: str | None = None
    # the uid the probe ran as: processes of other uids on the GPUs are someone else's
    probe_uid: int | None = None
    # RLIMIT_MEMLOCK soft limit in bytes; -1 for unlimited (RDMA needs unlimited)
    memlock_limit_bytes: int | None = None
    loaded_modules: list[str] | None = None
    # other processes' CPU use over a short sample (doctor and probe take one); None where none was taken
    cpu_busy: CpuBusy | None = None


# ------------------------------------------------------------------------------------------ storage


@dataclass
class BlockDevice:
    name: str
    kind: str  # nvme | ssd | hdd | virtual
    rotational: bool | None = None
    size_bytes: int | None = None
    model: str | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None


@dataclass
class Mount:
    device: str
    mountpoint: str
    fstype: str
    network: bool = False  # nfs, cifs, ceph, lustre, hdfs...
    fuse: bool = False
    options: str | None = None  # as in /proc/self/mounts: "rw,relatime,vers=4.2,rsize=1048576"
    total_bytes: int | None = None
    free_bytes: int | None = None
    inodes_total: int | None = None
    inodes_free: int | None = None
    # the block device under it (e.g. "nvme0n1"), where one was found
    block_device: str | None = None


@dataclass
class DataPath:
    """A path the user named (``--data``), resolved to the mount that holds it."""

    path: str
    exists: bool
    mountpoint: str | None = None
    fstype: str | None = None


@dataclass
class StorageInfo:
    block_devices: list[BlockDevice] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)
    data_paths: list[DataPath] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ network


@dataclass
class NetInterface:
    name: str
    kind: str  # physical | virtual | loopback
    operstate: str | None = None
    speed_mbps: int | None = None
    mtu: int | None = None
    numa_node: int | None = None
    driver: str | None = None


@dataclass
class IbPort:
    device: str  # mlx5_0
    port: int
    state: str | None = None  # ACTIVE, DOWN, INIT...
    phys_state: str | None = None  # LinkUp, Polling, Disabled...
    rate_gbps: float | None = None
    link_layer: str | None = None  # InfiniBand | Ethernet (RoCE)
    numa_node: int | None = None
    # the netdev behind a RoCE port (e.g. "ens1f0np0")
    netdev: str | None = None


@dataclass
class TcpSettings:
    congestion_control: str | None = None
    available_congestion_control: list[str] | None = None
    rmem_max_bytes: int | None = None
    wmem_max_bytes: int | None = None
    # the autotuning ceilings (third field of net.ipv4.tcp_rmem / tcp_wmem)
    tcp_rmem_max_bytes: int | None = None
    tcp_wmem_max_bytes: int | None = None
    window_scaling: bool | None = None
    slow_start_after_idle: bool | None = None
    default_qdisc: str | None = None


@dataclass
class NetworkInfo:
    interfaces: list[NetInterface] = field(default_factory=list)
    ib_ports: list[IbPort] = field(default_factory=list)
    tcp: TcpSettings = field(default_factory=TcpSettings)


# ----------------------------------------------------------------------------------------- software


@dataclass
class TorchInfo:
    version: str
    cuda: str | None = None  # torch.version.cuda; None for a CPU build
    hip: str | None = None
    cudnn: int | None = None  # e.g. 90100
    nccl: str | None = None  # "2.21.5"
    nccl_available: bool | None = None
    gloo_available: bool | None = None
    matmul_allow_tf32: bool | None = None
    cudnn_allow_tf32: bool | None = None
    cudnn_benchmark: bool | None = None
    float32_matmul_precision: str | None = None


@dataclass
class SoftwareInfo:
    python: str | None = None
    platform: str | None = None
    redline: str | None = None
    # None: torch not installed (or not importable, see import_errors)
    torch: TorchInfo | None = None
    # package -> version for the inference and runtime stack (tensorrt, onnxruntime...); absent = not found
    packages: dict[str, str] = field(default_factory=dict)
    # NCCL_*, CUDA_*, TORCH_*, OMP_NUM_THREADS... as set in the probe's environment
    env: dict[str, str] = field(default_factory=dict)
    nvidia_kernel_driver: str | None = None  # from /proc/driver/nvidia/version
    # the open GPU kernel module (required for DMA-BUF GPUDirect RDMA without nvidia_peermem)
    nvidia_open_kernel_module: bool | None = None
    import_errors: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- snapshot


@dataclass
class Snapshot:
    schema_version: int = SCHEMA_VERSION
    taken_at: str | None = None  # ISO 8601, UTC
    gpu: GpuSection = field(default_factory=GpuSection)
    host: HostInfo = field(default_factory=HostInfo)
    storage: StorageInfo = field(default_factory=StorageInfo)
    network: NetworkInfo = field(default_factory=NetworkInfo)
    software: SoftwareInfo = field(default_factory=SoftwareInfo)
    # what went wrong part-way ("/sys/.../speed: 'garbage' is not a number"); the rest was still probed
    probe_errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @property
    def gpus(self) -> list[Gpu]:
        return self.gpu.gpus


def snapshot_from_dict(data: Any) -> Snapshot:
    """Validate plain data (parsed JSON) into a Snapshot; raise SnapshotError naming the bad field."""
    from pydantic import TypeAdapter, ValidationError  # lazy: keeps `import redline` light

    if not isinstance(data, dict):
        raise SnapshotError(f"a snapshot is a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SnapshotError("not a redline snapshot: no integer 'schema_version'")
    if version > SCHEMA_VERSION:
        raise SnapshotError(
            f"snapshot schema {version} is newer than this redline understands ({SCHEMA_VERSION}); upgrade redline"
        )
    try:
        snapshot = TypeAdapter(Snapshot).validate_python(data, strict=False)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "<root>"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise SnapshotError(f"field '{where}': {first['msg']}{more}") from None
    _check_quantities(snapshot, "")
    return snapshot


# quantities that cannot be negative; a negative one means a corrupted or hand-edited snapshot
_UNIT_SUFFIXES = ("_bytes", "_w", "_mhz", "_c", "_mbps", "_gbps", "_cores", "_count", "_ratio")
# RLIMIT_MEMLOCK: -1 stands for unlimited
_NEGATIVE_ALLOWED = {"memlock_limit_bytes"}


def _check_quantities(obj: Any, where: str) -> None:
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            path = f"{where}.{f.name}" if where else f.name
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and value < 0
                and f.name.endswith(_UNIT_SUFFIXES)
                and f.name not in _NEGATIVE_ALLOWED
            ):
                raise SnapshotError(f"field '{path}': {value} is negative")
            _check_quantities(value, path)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            _check_quantities(item, f"{where}.{i}")


def load_snapshot(path: str | Path) -> Snapshot:
    """Read a snapshot written by ``redline probe --json``; '-' reads standard input."""
    import sys

    from redline.files import TEXT_LIMIT_BYTES, read_user_file

    try:
        # never a FIFO or a device, never past the cap (a snapshot is tens of KiB)
        text = sys.stdin.read(TEXT_LIMIT_BYTES + 1) if str(path) == "-" else read_user_file(path, "snapshot")
    except BadInput as exc:
        raise SnapshotError(str(exc)) from None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SnapshotError(f"snapshot {path} is not UTF-8 text") from None
    if len(text) > TEXT_LIMIT_BYTES:
        raise SnapshotError(f"snapshot {path} is over the {TEXT_LIMIT_BYTES // 2**20} MiB one may be")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"snapshot {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    try:
        return snapshot_from_dict(data)
    except SnapshotError as exc:
        raise SnapshotError(f"snapshot {path}: {exc}") from None
