"""The host around the GPUs: CPUs, memory, cgroup limits, NUMA, and the kernel knobs that starve GPUs.

Every /sys, /proc and /etc read goes through the ``SysFs`` passed in, so tests can point it at a fake
tree. What the kernel does not expose (no cpufreq in a VM, no cgroup limit) comes back as ``None``.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import socket
from collections import Counter
from collections.abc import Callable

from redline.hw.snapshot import HostInfo, NumaNode
from redline.hw.sysfs import SysFs
from redline.units import GiB

# the /dev/shm a host should give DataLoader workers, which pass batches through it (docker's default is 64 MiB)
SHM_MIN_BYTES = 1 * GiB

# cgroup v1 has no "max": an unlimited memory cgroup reports a page-rounded 2^63 - 1. Anything this big
# (far beyond any real machine) means "no limit".
_CGROUP_V1_UNLIMITED = 1 << 62


def probe_host(fs: SysFs, statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> HostInfo:
    """Everything about the host that is not a GPU; ``statvfs`` is injectable so tests can fake /dev/shm."""
    cpus = _read_cpuinfo(fs)
    meminfo = _read_meminfo(fs)
    swap_total, swap_free = meminfo.get("SwapTotal"), meminfo.get("SwapFree")
    shm = _shm_space(fs, statvfs)
    process_cpus = _process_cpus()
    return HostInfo(
        hostname=_hostname(),
        kernel=os.uname().release,
        os_name=_os_name(fs),
        cpu_model=_cpu_model(cpus),
        cpu_logical_cores=len(cpus) or None,
        cpu_physical_cores=_physical_cores(cpus),
        cpu_governors=_cpu_governors(fs),
        cpu_arch=platform.machine() or None,
        hypervisor=_hypervisor(cpus),
        process_cpu_count=None if process_cpus is None else len(process_cpus),
        process_cpus=process_cpus,
        cgroup_cpu_limit_cores=_cgroup_cpu_limit(fs),
        cgroup_memory_limit_bytes=_cgroup_memory_limit(fs),
        memory_total_bytes=meminfo.get("MemTotal"),
        memory_available_bytes=meminfo.get("MemAvailable"),
        swap_total_bytes=swap_total,
        swap_used_bytes=swap_total - swap_free if swap_total is not None and swap_free is not None else None,
        swappiness=fs.read_int("/proc/sys/vm/swappiness"),
        shm_total_bytes=shm[0] if shm else None,
        shm_free_bytes=shm[1] if shm else None,
        numa_nodes=_numa_nodes(fs),
        numa_balancing=_numa_balancing(fs),
        kernel_cmdline=fs.read("/proc/cmdline"),
        iommu_mode=_iommu_mode(fs),
        probe_uid=os.getuid(),
        memlock_limit_bytes=_memlock_limit(),
        loaded_modules=_loaded_modules(fs),
    )


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8-11' -> [0, 1, 2, 3, 8, 9, 10, 11]; '' -> [] (a memory-only NUMA node); ValueError on garbage."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


# ---------------------------------------------------------------------------------- identity


def _hostname() -> str | None:
    try:
        return socket.gethostname() or None
    except OSError:
        return None


def _os_name(fs: SysFs) -> str | None:
    """PRETTY_NAME from os-release; /usr/lib/os-release is the spec's fallback when /etc has none."""
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        name = fs.read_kv(path, sep="=").get("PRETTY_NAME")
        if name:
            return name.strip("\"'")
    return None


# --------------------------------------------------------------------------------------- CPU


def _read_cpuinfo(fs: SysFs) -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU (the blocks that have a 'processor' line)."""
    cpus: list[dict[str, str]] = []
    for line in fs.read_lines("/proc/cpuinfo"):
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            cpus.append({})
        if cpus:
            cpus[-1][key] = value
    return cpus


def _cpu_model(cpus: list[dict[str, str]]) -> str | None:
    """x86 says 'model name'; some ARM kernels only say 'Model' or 'Hardware' (Grace says neither)."""
    for key in ("model name", "Model", "Hardware"):
        for cpu in cpus:
            if cpu.get(key):
                return cpu[key]
    return None


def _physical_cores(cpus: list[dict[str, str]]) -> int | None:
    """Unique (socket, core) pairs, so SMT siblings count once; the logical count where cpuinfo has no
    topology (ARM, some VMs), which is right on CPUs without SMT and an overcount otherwise."""
    cores = {(cpu.get("physical id"), cpu["core id"]) for cpu in cpus if "core id" in cpu}
    return len(cores) or len(cpus) or None


def _cpu_governors(fs: SysFs) -> dict[str, int] | None:
    """How many CPUs run each cpufreq governor: 'powersave' on a GPU server slows kernel launches."""
    governors: Counter[str] = Counter()
    for name in fs.listdir("/sys/devices/system/cpu"):
        if re.fullmatch(r"cpu\d+", name):
            governor = fs.read(f"/sys/devices/system/cpu/{name}/cpufreq/scaling_governor")
            if governor:
                governors[governor] += 1
    return dict(sorted(governors.items())) or None


def under_hypervisor(fs: SysFs) -> bool | None:
    """Whether this is a virtual machine, from the CPU flags in /proc/cpuinfo (see ``_hypervisor``)."""
    return _hypervisor(_read_cpuinfo(fs))


def _hypervisor(cpus: list[dict[str, str]]) -> bool | None:
    """The x86 'hypervisor' CPU flag, which every hypervisor sets for its guests: a cloud VM, where
    disks, NICs and GPUs may be virtual or passed through. None where cpuinfo lists no flags (ARM says
    'Features' and has no such flag)."""
    flags = next((cpu["flags"] for cpu in cpus if "flags" in cpu), None)
    return None if flags is None else "hypervisor" in flags.split()


def _process_cpus() -> list[int] | None:
    """The CPUs this process may use: a container or taskset can hide most of the machine's cores."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, which a container or taskset narrows, or every CPU
    of the machine where the platform has no affinity (macOS). At least one."""
    cpus = _process_cpus()
    return len(cpus) if cpus else os.cpu_count() or 1


def usable_cores(fs: SysFs | None = None) -> int:
    """The cores this process can keep busy: its CPU affinity, cut to its cgroup's CPU quota (whole cores,
    at least one). What a launcher divides among its processes' threads."""
    cores = usable_cpus()
    quota = _cgroup_cpu_limit(fs or SysFs())
    if quota is not None:
        cores = min(cores, int(quota))
    return max(1, cores)


# ------------------------------------------------------------------------------------ cgroups


def _own_cgroups(fs: SysFs) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ('' is the cgroup v2 entry)."""
    paths: dict[str, str] = {}
    for line in fs.read_lines("/proc/self/cgroup"):
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _cgroup_file(fs: SysFs, mount: str, own_path: str | None, name: str) -> str | None:
    """Where a cgroup file is: in this process's own cgroup, else at the hierarchy's root; None if neither.

    Without a cgroup namespace /sys/fs/cgroup is the host's whole tree and our limit sits under our own
    path; inside a namespace (most containers) our path reads '/' or is absent and the root is ours.
    """
    own = f"{mount}/{own_path.strip('/')}".rstrip("/") if own_path else mount
    for directory in dict.fromkeys([own, mount]):
        if fs.exists(f"{directory}/{name}"):
            return f"{directory}/{name}"
    return None


def _to_int(fs: SysFs, path: str, text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        fs.errors.append(f"{path}: {text[:40]!r} is not a number")
        return None


def _cgroup_cpu_limit(fs: SysFs) -> float | None:
    """The CPU quota in cores (cgroup v2 cpu.max, else v1 cfs quota/period); None when unlimited."""
    own = _own_cgroups(fs)
    cpu_max = _cgroup_file(fs, "/sys/fs/cgroup", own.get(""), "cpu.max")
    if cpu_max is not None:
        quota, _, period = (fs.read(cpu_max) or "").partition(" ")
        if quota in ("max", ""):
            return None
        quota_us, period_us = _to_int(fs, cpu_max, quota), _to_int(fs, cpu_max, period or "100000")
    else:
        quota_file = _cgroup_file(fs, "/sys/fs/cgroup/cpu", own.get("cpu"), "cpu.cfs_quota_us")
        period_file = _cgroup_file(fs, "/sys/fs/cgroup/cpu", own.get("cpu"), "cpu.cfs_period_us")
        if quota_file is None or period_file is None:
            return None
        quota_us, period_us = fs.read_int(quota_file), fs.read_int(period_file)
    if quota_us is None or period_us is None or quota_us < 0 or period_us <= 0:
        return None
    return quota_us / period_us


def cgroup_pids_limit(fs: SysFs) -> int | None:
    """The most tasks (processes and threads) this process's cgroup may hold (v2 pids.max, else v1's); None
    when unlimited or without the controller."""
    own = _own_cgroups(fs)
    path = _cgroup_file(fs, "/sys/fs/cgroup", own.get(""), "pids.max") or _cgroup_file(
        fs, "/sys/fs/cgroup/pids", own.get("pids"), "pids.max"
    )
    text = fs.read(path) if path else None
    if path is None or text is None or text in ("max", ""):
        return None
    return _to_int(fs, path, text)


def _cgroup_memory_limit(fs: SysFs) -> int | None:
    """The memory limit in bytes (cgroup v2 memory.max, else v1 limit_in_bytes); None when unlimited."""
    own = _own_cgroups(fs)
    memory_max = _cgroup_file(fs, "/sys/fs/cgroup", own.get(""), "memory.max")
    if memory_max is not None:
        text = fs.read(memory_max)
        return None if text in ("max", "", None) else _to_int(fs, memory_max, text)
    limit_file = _cgroup_file(fs, "/sys/fs/cgroup/memory", own.get("memory"), "memory.limit_in_bytes")
    limit = fs.read_int(limit_file) if limit_file else None
    return None if limit is None or limit >= _CGROUP_V1_UNLIMITED else limit


# ------------------------------------------------------------------------------------- memory


def _kb_to_bytes(fs: SysFs, path: str, key: str, value: str) -> int | None:
    """'24684096 kB' -> bytes (meminfo says kB and means KiB)."""
    number, _, unit = value.partition(" ")
    try:
        return int(number) * (1024 if unit.strip() == "kB" else 1)
    except ValueError:
        fs.errors.append(f"{path} {key}: {value[:40]!r} is not a number")
        return None


def _read_meminfo(fs: SysFs) -> dict[str, int]:
    """The /proc/meminfo lines we use, in bytes; a line that is missing or unreadable is left out."""
    meminfo = fs.read_kv("/proc/meminfo", sep=":")
    wanted = ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")
    values = {key: _kb_to_bytes(fs, "/proc/meminfo", key, meminfo[key]) for key in wanted if key in meminfo}
    return {key: value for key, value in values.items() if value is not None}


def _shm_space(fs: SysFs, statvfs: Callable[[str], os.statvfs_result]) -> tuple[int, int] | None:
    """(total, free) bytes of /dev/shm: Docker's 64 MB default breaks NCCL and DataLoader workers."""
    path = fs.path("/dev/shm")
    if not path.exists():
        return None
    try:
        st = statvfs(str(path))
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK soft limit; -1 for unlimited. RDMA (GPUDirect, NCCL over IB) pins memory."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return None
    return -1 if soft == resource.RLIM_INFINITY else soft


# --------------------------------------------------------------------------------------- NUMA


def _numa_nodes(fs: SysFs) -> list[NumaNode] | None:
    """Each NUMA node's CPUs and memory, for pinning data loaders near their GPU; None without NUMA info."""
    nodes: list[NumaNode] = []
    names = [name for name in fs.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", name)]
    for name in sorted(names, key=lambda n: int(n[4:])):
        base = f"/sys/devices/system/node/{name}"
        text = fs.read(f"{base}/cpulist")
        try:
            cpus = parse_cpulist(text or "")
        except ValueError:
            fs.errors.append(f"{base}/cpulist: {(text or '')[:40]!r} is not a CPU list")
            cpus = []
        nodes.append(NumaNode(node=int(name[4:]), cpus=cpus, memory_total_bytes=_node_memory(fs, base)))
    return nodes or None


def _node_memory(fs: SysFs, base: str) -> int | None:
    """'Node 0 MemTotal:  4942040 kB' from the node's own meminfo."""
    for line in fs.read_lines(f"{base}/meminfo"):
        match = re.match(r"Node\s+\d+\s+MemTotal:\s+(.*)", line)
        if match:
            return _kb_to_bytes(fs, f"{base}/meminfo", "MemTotal", match.group(1))
    return None


def _iommu_mode(fs: SysFs) -> str | None:
    """How the IOMMU treats the host's DMA: "translated" (any group of type DMA or DMA-FQ) costs
    GPUDirect RDMA and NCCL P2P throughput; "passthrough" (identity, iommu=pt) and "off" (no groups) do
    not. Groups handed to VFIO ("unmanaged") or blocked say nothing about the host and are skipped.
    None where /sys/kernel/iommu_groups is absent, or no group says its type (kernels before 5.11)."""
    base = "/sys/kernel/iommu_groups"
    if not fs.exists(base):
        return None
    groups = fs.listdir(base)
    if not groups:
        return "off"
    types = {fs.read(f"{base}/{group}/type") for group in groups}
    if any(kind and kind.startswith("DMA") for kind in types):
        return "translated"
    if "identity" in types:
        return "passthrough"
    return None


def _numa_balancing(fs: SysFs) -> bool | None:
    """Automatic NUMA balancing migrates pages under a running job (0 off, 1 on, 2 tiering)."""
    value = fs.read_int("/proc/sys/kernel/numa_balancing")
    return None if value is None else value != 0


# ------------------------------------------------------------------------------------ modules


def _loaded_modules(fs: SysFs) -> list[str] | None:
    """Names from /proc/modules (nvidia_peermem, nv_peer_mem...); None where the file is absent."""
    text = fs.read("/proc/modules")
    if text is None:
        return None
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process descended from it that is alive now (empty when ``pid`` is gone): a queued
    job's launcher and its ranks, whose GPU memory is the job's."""
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid, *(child.pid for child in root.children(recursive=True))}
    except psutil.Error:
        return set()
