"""A fake /sys, /proc and /etc tree under a temporary directory, for probes that read through SysFs.

    root = SysRoot(tmp_path)
    root.write("/proc/meminfo", "MemTotal: 1024 kB\\n")
    root.add_cpu(0, governor="performance")
    root.add_nic("eth0", speed=100000, numa_node=1)
    host = probe_host(root.sysfs())

Each helper writes the few files a probe reads, shaped like the real kernel's (symlinks included where
the probe follows one). ``fake_statvfs`` stands in for os.statvfs on paths the tree cannot fake.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from redline.hw.sysfs import SysFs

StatVfs = Callable[[str], os.statvfs_result]


class SysRoot:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._cpuinfo: list[str] = []

    def sysfs(self) -> SysFs:
        """A fresh SysFs over this tree (its ``errors`` start empty)."""
        return SysFs(self.root)

    def path(self, path: str) -> Path:
        """Where an absolute path ('/proc/meminfo') lives in this tree."""
        return self.root / path.lstrip("/")

    # -------------------------------------------------------------------------------- raw files

    def write(self, path: str, text: str | int) -> Path:
        """Write a file (parents created); ints are written as sysfs does, with a newline."""
        real = self.path(path)
        real.parent.mkdir(parents=True, exist_ok=True)
        real.write_text(f"{text}\n" if isinstance(text, int) else text)
        return real

    def append(self, path: str, line: str) -> Path:
        real = self.path(path)
        real.parent.mkdir(parents=True, exist_ok=True)
        with real.open("a") as file:
            file.write(line.rstrip("\n") + "\n")
        return real

    def mkdir(self, path: str) -> Path:
        real = self.path(path)
        real.mkdir(parents=True, exist_ok=True)
        return real

    def symlink(self, path: str, target: str) -> Path:
        """A symlink at ``path``. An absolute ``target`` means a path inside this tree (the link is made
        relative so it resolves here); a relative one is kept as written (e.g. '../../drivers/mlx5_core')."""
        link = self.path(path)
        link.parent.mkdir(parents=True, exist_ok=True)
        if target.startswith("/"):
            target = os.path.relpath(self.path(target), link.parent)
        link.symlink_to(target)
        return link

    def unreadable(self, path: str) -> Path:
        """Make ``path`` exist but fail to read (a directory), like a down link's 'speed' (EINVAL)."""
        return self.mkdir(path)

    # ------------------------------------------------------------------------------------- host

    def add_cpu(
        self,
        index: int,
        *,
        model: str = "AMD EPYC 9654 96-Core Processor",
        physical_id: int | None = 0,
        core_id: int | None = None,
        governor: str | None = None,
        flags: str | None = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx lm",
    ) -> None:
        """One logical CPU: a /proc/cpuinfo block, and a cpufreq governor if given. The default flags are
        a bare-metal x86 CPU's; add 'hypervisor' for a VM, or pass None for a CPU that lists none (ARM)."""
        block = [f"processor\t: {index}", f"model name\t: {model}"]
        if physical_id is not None:
            block.append(f"physical id\t: {physical_id}")
        block.append(f"core id\t\t: {index if core_id is None else core_id}")
        if flags is not None:
            block.append(f"flags\t\t: {flags}")
        self._cpuinfo.append("\n".join(block) + "\n")
        self.write("/proc/cpuinfo", "\n".join(self._cpuinfo))
        self.mkdir(f"/sys/devices/system/cpu/cpu{index}")
        if governor is not None:
            self.write(f"/sys/devices/system/cpu/cpu{index}/cpufreq/scaling_governor", governor)

    def meminfo(self, **kb: int) -> None:
        """/proc/meminfo from keyword values in kB: meminfo(MemTotal=2048, SwapTotal=0)."""
        self.write("/proc/meminfo", "".join(f"{key}:{value:>16} kB\n" for key, value in kb.items()))

    def add_process(self, pid: int, comm: str, uid: int) -> None:
        """A process as /proc shows it: its name in comm, its real, effective, saved and fs uids in status."""
        self.write(f"/proc/{pid}/comm", f"{comm}\n")
        self.write(f"/proc/{pid}/status", f"Name:\t{comm}\nPid:\t{pid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")

    def add_numa_node(self, node: int, cpulist: str, memory_kb: int | None = None) -> None:
        base = f"/sys/devices/system/node/node{node}"
        self.write(f"{base}/cpulist", cpulist)
        if memory_kb is not None:
            self.write(f"{base}/meminfo", f"Node {node} MemTotal:       {memory_kb} kB\nNode {node} MemFree: 1 kB\n")

    # ---------------------------------------------------------------------------------- storage

    def add_block_device(
        self,
        name: str,
        *,
        rotational: int | None = 0,
        sectors: int | None = 2_000_000,
        model: str | None = None,
        vendor: str | None = None,
        link_speed: str | None = None,
        link_width: int | None = None,
        max_link_speed: str | None = None,
        max_link_width: int | None = None,
    ) -> None:
        """A disk under /sys/block; the link_* files go on the PCI function, as for NVMe namespaces."""
        base = f"/sys/block/{name}"
        self.mkdir(base)
        if rotational is not None:
            self.write(f"{base}/queue/rotational", rotational)
        if sectors is not None:
            self.write(f"{base}/size", sectors)
        if model is not None:
            self.write(f"{base}/device/model", f"{model}    \n")  # the kernel pads models with spaces
        if vendor is not None:
            self.write(f"{base}/device/vendor", f"{vendor:<8}\n")  # SCSI vendors are padded to 8
        pci = f"{base}/device/device"
        for file, value in [
            ("current_link_speed", link_speed),
            ("current_link_width", link_width),
            ("max_link_speed", max_link_speed),
            ("max_link_width", max_link_width),
        ]:
            if value is not None:
                self.write(f"{pci}/{file}", value)

    def add_mount(self, device: str, mountpoint: str, fstype: str, options: str = "rw,relatime") -> None:
        """A line of /proc/self/mounts, with spaces, tabs, newlines and backslashes octal-escaped."""
        self.append("/proc/self/mounts", f"{_escape(device)} {_escape(mountpoint)} {fstype} {options} 0 0")

    # ---------------------------------------------------------------------------------- network

    def add_nic(
        self,
        name: str,
        *,
        physical: bool = True,
        operstate: str = "up",
        speed: int | str | None = 100000,
        mtu: int = 1500,
        numa_node: int | None = -1,
        driver: str | None = "mlx5_core",
    ) -> None:
        """An interface in /sys/class/net; a physical one has a device/ (with numa_node and a driver link)."""
        base = f"/sys/class/net/{name}"
        self.write(f"{base}/operstate", operstate)
        self.write(f"{base}/mtu", mtu)
        if speed is not None:
            self.write(f"{base}/speed", speed)
        if physical:
            self.mkdir(f"{base}/device")
            if numa_node is not None:
                self.write(f"{base}/device/numa_node", numa_node)
            if driver is not None:
                self.symlink(f"{base}/device/driver", f"../../../bus/pci/drivers/{driver}")

    def add_ib_port(
        self,
        device: str,
        port: int = 1,
        *,
        state: str = "4: ACTIVE",
        phys_state: str = "5: LinkUp",
        rate: str = "400 Gb/sec (4X NDR)",
        link_layer: str = "InfiniBand",
        numa_node: int | None = 0,
        netdev: str | None = None,
    ) -> None:
        """A port under /sys/class/infiniband; ``netdev`` adds device/net/<netdev> as a RoCE HCA has."""
        base = f"/sys/class/infiniband/{device}"
        for file, value in [
            ("state", state),
            ("phys_state", phys_state),
            ("rate", rate),
            ("link_layer", link_layer),
        ]:
            self.write(f"{base}/ports/{port}/{file}", value)
        if numa_node is not None:
            self.write(f"{base}/device/numa_node", numa_node)
        if netdev is not None:
            self.mkdir(f"{base}/device/net/{netdev}")


def _escape(field: str) -> str:
    return "".join(f"\\{ord(char):03o}" if char in " \t\n\\" else char for char in field)


def statvfs_result(
    total_bytes: int, free_bytes: int, inodes_total: int = 1_000_000, inodes_free: int = 900_000
) -> os.statvfs_result:
    """An os.statvfs_result with 4 KiB blocks; free_bytes is what non-root may use (f_bavail)."""
    block = 4096
    blocks, free = total_bytes // block, free_bytes // block
    return os.statvfs_result((block, block, blocks, free, free, inodes_total, inodes_free, inodes_free, 0, 255))


def fake_statvfs(results: Mapping[str, os.statvfs_result | BaseException]) -> StatVfs:
    """A statvfs that answers from ``results`` (an exception is raised) and ENOENT for anything else."""

    def statvfs(path: str) -> os.statvfs_result:
        result = results.get(str(path))
        if result is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        if isinstance(result, BaseException):
            raise result
        return result

    return statvfs
