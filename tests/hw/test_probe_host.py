"""probe_host against fake /proc and /sys trees, and against this machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from redline.hw.host import parse_cpulist, probe_host, usable_cpus
from redline.hw.sysfs import SysFs
from sysroot import SysRoot, fake_statvfs, statvfs_result

GiB = 1 << 30
MB = 1 << 20


@pytest.fixture
def gpu_server(tmp_path: Path) -> SysRoot:
    """A 2-socket, 2-NUMA-node box with SMT, in a cgroup v2 container limited to 4 CPUs and 64 GiB."""
    root = SysRoot(tmp_path)
    root.write("/etc/os-release", 'NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\n')
    for cpu in range(16):
        socket, core = divmod(cpu % 8, 4)  # cpus 8-15 are the SMT siblings of 0-7
        governor = "powersave" if cpu in (3, 11) else "performance"
        root.add_cpu(cpu, model="Intel(R) Xeon(R) Platinum 8480+", physical_id=socket, core_id=core, governor=governor)
    root.add_numa_node(0, "0-3,8-11", memory_kb=512 * 1024 * 1024)
    root.add_numa_node(1, "4-7,12-15", memory_kb=512 * 1024 * 1024)
    root.write("/proc/self/cgroup", "0::/\n")
    root.write("/sys/fs/cgroup/cpu.max", "400000 100000")
    root.write("/sys/fs/cgroup/memory.max", 64 * GiB)
    root.meminfo(
        MemTotal=1024 * 1024 * 1024,
        MemFree=1,
        MemAvailable=900 * 1024 * 1024,
        SwapTotal=8 * 1024 * 1024,
        SwapFree=6 * 1024 * 1024,
    )
    root.write("/proc/sys/vm/swappiness", 60)
    root.write("/proc/sys/kernel/numa_balancing", 1)
    root.write("/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 iommu=pt\n")
    root.write("/proc/modules", "nvidia_peermem 16384 0 - Live 0x0\nnvidia 56672256 2 nvidia_peermem, Live 0x0\n")
    root.mkdir("/dev/shm")
    return root


def test_gpu_server(gpu_server: SysRoot) -> None:
    shm = str(gpu_server.path("/dev/shm"))
    fs = gpu_server.sysfs()
    host = probe_host(fs, statvfs=fake_statvfs({shm: statvfs_result(64 * MB, 60 * MB)}))

    assert host.os_name == "Ubuntu 22.04.4 LTS"
    assert host.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert (host.cpu_logical_cores, host.cpu_physical_cores) == (16, 8)
    assert host.cpu_governors == {"performance": 14, "powersave": 2}
    assert host.cgroup_cpu_limit_cores == 4.0
    assert host.cgroup_memory_limit_bytes == 64 * GiB
    assert host.memory_total_bytes == 1024 * GiB
    assert host.memory_available_bytes == 900 * GiB
    assert (host.swap_total_bytes, host.swap_used_bytes) == (8 * GiB, 2 * GiB)
    assert host.swappiness == 60
    assert (host.shm_total_bytes, host.shm_free_bytes) == (64 * MB, 60 * MB)
    assert host.numa_nodes is not None
    assert [node.node for node in host.numa_nodes] == [0, 1]
    assert host.numa_nodes[1].cpus == [4, 5, 6, 7, 12, 13, 14, 15]
    assert host.numa_nodes[0].memory_total_bytes == 512 * GiB
    assert host.numa_balancing is True
    assert host.kernel_cmdline == "BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 iommu=pt"
    assert host.loaded_modules == ["nvidia_peermem", "nvidia"]
    assert host.hypervisor is False  # cpuinfo has flags, without "hypervisor": bare metal
    assert host.iommu_mode is None  # no /sys/kernel/iommu_groups in this tree
    assert host.probe_uid == os.getuid()
    assert host.cpu_arch == platform.machine()
    assert fs.errors == []


def test_an_empty_tree_is_all_none(tmp_path: Path) -> None:
    """No cpufreq, no cgroup, no meminfo, no /dev/shm: everything read from the tree is None."""
    fs = SysFs(tmp_path)
    host = probe_host(fs, statvfs=fake_statvfs({}))
    for name in (
        "os_name", "cpu_model", "cpu_logical_cores", "cpu_physical_cores", "cpu_governors",
        "cgroup_cpu_limit_cores", "cgroup_memory_limit_bytes", "memory_total_bytes", "swap_used_bytes",
        "swappiness", "shm_total_bytes", "numa_nodes", "numa_balancing", "kernel_cmdline", "loaded_modules",
        "hypervisor", "iommu_mode",
    ):  # fmt: skip
        assert getattr(host, name) is None, name
    assert fs.errors == []


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5), ("max", None)],
)
def test_cgroup_v2_cpu_max(tmp_path: Path, cpu_max: str, cores: float | None) -> None:
    root = SysRoot(tmp_path)
    root.write("/sys/fs/cgroup/cpu.max", cpu_max)
    assert probe_host(root.sysfs()).cgroup_cpu_limit_cores == cores


def test_cgroup_v2_memory_max_unlimited(tmp_path: Path) -> None:
    root = SysRoot(tmp_path)
    root.write("/sys/fs/cgroup/memory.max", "max")
    assert probe_host(root.sysfs()).cgroup_memory_limit_bytes is None


@pytest.mark.parametrize(
    ("quota", "limit", "cores", "memory"),
    [
        (-1, 9223372036854771712, None, None),  # what an unlimited v1 cgroup reads
        (250000, 16 * GiB, 2.5, 16 * GiB),
    ],
)
def test_cgroup_v1(tmp_path: Path, quota: int, limit: int, cores: float | None, memory: int | None) -> None:
    root = SysRoot(tmp_path)
    root.write("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", quota)
    root.write("/sys/fs/cgroup/cpu/cpu.cfs_period_us", 100000)
    root.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", limit)
    host = probe_host(root.sysfs())
    assert (host.cgroup_cpu_limit_cores, host.cgroup_memory_limit_bytes) == (cores, memory)


def test_cgroup_limit_is_read_from_the_process_own_cgroup(tmp_path: Path) -> None:
    """Without a cgroup namespace the mount is the host's root; the limit is under our own path."""
    root = SysRoot(tmp_path)
    root.write("/proc/self/cgroup", "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n")
    root.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", 9223372036854771712)
    root.write("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", 8 * GiB)
    root.write("/sys/fs/cgroup/cpu/docker/abc/cpu.cfs_quota_us", 800000)
    root.write("/sys/fs/cgroup/cpu/docker/abc/cpu.cfs_period_us", 100000)
    host = probe_host(root.sysfs())
    assert (host.cgroup_cpu_limit_cores, host.cgroup_memory_limit_bytes) == (8.0, 8 * GiB)


def test_garbage_is_none_and_noted(tmp_path: Path) -> None:
    root = SysRoot(tmp_path)
    root.write("/sys/fs/cgroup/memory.max", "lots")
    root.write("/proc/meminfo", "MemTotal:  many kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    root.add_numa_node(0, "0-x")
    fs = root.sysfs()
    host = probe_host(fs)
    assert host.cgroup_memory_limit_bytes is None
    assert host.memory_total_bytes is None
    assert host.swap_used_bytes == 0
    assert host.numa_nodes is not None and host.numa_nodes[0].cpus == []
    assert len(fs.errors) == 3
    assert any("memory.max" in error and "'lots'" in error for error in fs.errors)


def test_cpuinfo_without_topology_counts_logical_cores(tmp_path: Path) -> None:
    """ARM kernels write no 'physical id' / 'core id' and often no model name."""
    root = SysRoot(tmp_path)
    root.write("/proc/cpuinfo", "".join(f"processor\t: {n}\nBogoMIPS\t: 2000.00\n\n" for n in range(4)))
    host = probe_host(root.sysfs())
    assert (host.cpu_model, host.cpu_logical_cores, host.cpu_physical_cores) == (None, 4, 4)
    assert host.hypervisor is None  # ARM lists 'Features', not 'flags': cannot say


def test_a_vm_has_the_hypervisor_flag(tmp_path: Path) -> None:
    root = SysRoot(tmp_path)
    for cpu in range(2):
        root.add_cpu(cpu, flags="fpu vme de pse tsc msr pae sse sse2 ht syscall nx lm hypervisor avx")
    assert probe_host(root.sysfs()).hypervisor is True


@pytest.mark.parametrize(
    ("types", "mode"),
    [
        (None, None),  # no /sys/kernel/iommu_groups: the kernel has no IOMMU support built in
        ([], "off"),  # the directory with no groups: IOMMU disabled
        (["identity", "identity"], "passthrough"),  # iommu=pt
        (["identity", "DMA-FQ"], "translated"),
        (["DMA", "DMA"], "translated"),
        (["identity", "unmanaged", "blocked"], "passthrough"),  # VFIO-owned groups say nothing of the host
        (["", ""], None),  # groups without a type file (kernels before 5.11)
    ],
)
def test_iommu_mode(tmp_path: Path, types: list[str] | None, mode: str | None) -> None:
    root = SysRoot(tmp_path)
    if types is not None:
        root.mkdir("/sys/kernel/iommu_groups")
    for group, kind in enumerate(types or []):
        root.mkdir(f"/sys/kernel/iommu_groups/{group}/devices")
        if kind:
            root.write(f"/sys/kernel/iommu_groups/{group}/type", f"{kind}\n")
    assert probe_host(root.sysfs()).iommu_mode == mode


def test_memory_only_numa_node(tmp_path: Path) -> None:
    """GH200's HBM and CXL memory show up as NUMA nodes with no CPUs."""
    root = SysRoot(tmp_path)
    root.add_numa_node(0, "0-71", memory_kb=1024)
    root.add_numa_node(1, "", memory_kb=2048)
    nodes = probe_host(root.sysfs()).numa_nodes
    assert nodes is not None
    assert [(node.cpus, node.memory_total_bytes) for node in nodes] == [
        (list(range(72)), 1024 * 1024),
        ([], 2048 * 1024),
    ]


def test_shm_that_cannot_be_statted_is_none(gpu_server: SysRoot) -> None:
    host = probe_host(gpu_server.sysfs(), statvfs=fake_statvfs({}))
    assert (host.shm_total_bytes, host.shm_free_bytes) == (None, None)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]), ("5", [5]), ("", []), ("0,2-3\n", [0, 2, 3])],
)
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


def test_parse_cpulist_garbage() -> None:
    with pytest.raises(ValueError):
        parse_cpulist("0-a")


def test_this_machine() -> None:
    fs = SysFs("/")
    host = probe_host(fs)
    assert host.hostname
    assert host.kernel
    assert host.memory_total_bytes is not None and host.memory_total_bytes > 0
    assert host.cpu_logical_cores is not None and host.cpu_logical_cores >= 1
    assert host.process_cpu_count is not None and host.process_cpu_count >= 1
    assert host.process_cpus == sorted(os.sched_getaffinity(0))
    assert len(host.process_cpus) == host.process_cpu_count
    assert host.cpu_arch == platform.machine() and host.probe_uid == os.getuid()
    assert host.memlock_limit_bytes is not None and (host.memlock_limit_bytes == -1 or host.memlock_limit_bytes >= 0)
    assert host.swap_used_bytes is None or host.swap_used_bytes >= 0
    assert fs.errors == []


def test_usable_cpus_follow_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """A taskset narrows the CPUs to two of the machine's 64: the runtime, tune and the journal count two."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    assert usable_cpus() == 2


@pytest.mark.parametrize("cpu_count, cpus", [(64, 64), (None, 1)])
def test_usable_cpus_without_affinity(monkeypatch: pytest.MonkeyPatch, cpu_count: int | None, cpus: int) -> None:
    """Where the platform has no affinity (macOS) every CPU counts, and at least one where even that is unknown."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
    assert usable_cpus() == cpus
