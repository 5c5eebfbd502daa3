"""Disks, mounts and the user's data paths: where training data comes from and how fast it can.

Block devices come from /sys/block and mounts from /proc/self/mounts, both through the ``SysFs``
passed in (as is /proc/cpuinfo, whose hypervisor flag helps tell a VM's virtual disks from real ones).
Free space comes from ``statvfs`` on the mountpoints themselves (injectable for tests), each call
bounded by a timeout because a hung NFS or FUSE mount blocks statvfs forever.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redline.hw.host import under_hypervisor
from redline.hw.snapshot import BlockDevice, DataPath, Mount, StorageInfo
from redline.hw.sysfs import SysFs

StatVfs = Callable[[str], os.statvfs_result]

# Seconds to wait for one statvfs; a module attribute so tests can shorten it.
STATVFS_TIMEOUT_S = 2.0

# Devices that hold no data worth auditing: loop images (snaps), RAM disks, swap-on-RAM, optical, floppy.
_SKIPPED_DEVICES = ("loop", "ram", "zram", "sr", "fd")

# Kernel interfaces mounted as filesystems: nothing to read or write data on.
_PSEUDO_FSTYPES = frozenset(
    {
        "proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
        "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "autofs", "binfmt_misc", "rpc_pipefs",
        "nsfs", "devtmpfs", "efivarfs", "selinuxfs",
    }
)  # fmt: skip

# Filesystems whose data crosses the network: throughput and latency depend on the link, not a disk.
_NETWORK_FSTYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs", "9p",
        "afs", "ocfs2", "orangefs", "wekafs",
    }
)  # fmt: skip

# FUSE programs (the subtype in 'fuse.<subtype>', or the device of a bare 'fuse' mount) that serve a
# remote filesystem or an object store.
_NETWORK_FUSE = frozenset(
    {
        "sshfs", "s3fs", "gcsfuse", "rclone", "goofys", "juicefs", "mountpoint-s3", "hdfs", "alluxio",
        "blobfuse", "blobfuse2", "ceph-fuse", "glusterfs", "geesefs", "s3ql", "seaweedfs", "ossfs",
    }
)  # fmt: skip

# Disks a hypervisor or cloud serves over its own storage stack, by /sys/block/<dev>/device/vendor
# (SCSI and ATA disks; stripped of the kernel's padding): Hyper-V/Azure, GCP persistent disk, QEMU/KVM,
# VMware (older versions write "VMware,").
_VIRTUAL_VENDORS = frozenset({"Msft", "Google", "QEMU", "VMware", "VMware,"})
# ...and by the start of device/model, for disks whose vendor says nothing (NVMe has no vendor file; QEMU's
# emulated SATA says "ATA"). Network-backed NVMe looks like a local drive by name: AWS EBS, and GCP
# persistent disk over NVMe ("nvme_card-pd"; GCP's local SSD is "nvme_card" and stays "nvme").
_VIRTUAL_MODELS = ("Amazon Elastic Block Store", "nvme_card-pd", "QEMU HARDDISK")

# PCIe transfer rate (GT/s) -> generation
_PCIE_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


@dataclass
class _MountLine:
    device: str
    mountpoint: str
    fstype: str
    options: str | None = None


def probe_storage(fs: SysFs, data_paths: Sequence[str] = (), statvfs: StatVfs = os.statvfs) -> StorageInfo:
    """Block devices, the mounts that hold data, and which mount each of ``data_paths`` lives on."""
    lines = _read_mounts(fs)
    hypervisor = under_hypervisor(fs) is True
    return StorageInfo(
        block_devices=[_block_device(fs, name, hypervisor) for name in fs.listdir("/sys/block") if _is_disk(name)],
        mounts=[_mount(fs, line, statvfs) for line in lines if _holds_data(line)],
        data_paths=[_data_path(path, lines) for path in data_paths],
    )


# ------------------------------------------------------------------------------ block devices


def _is_disk(name: str) -> bool:
    return not name.startswith(_SKIPPED_DEVICES)


def _block_device(fs: SysFs, name: str, hypervisor: bool) -> BlockDevice:
    base = f"/sys/block/{name}"
    rotational = fs.read_int(f"{base}/queue/rotational")
    sectors = fs.read_int(f"{base}/size")
    model = fs.read(f"{base}/device/model") or None
    vendor = fs.read(f"{base}/device/vendor") or None
    pci = f"{base}/device/device"  # namespace -> NVMe controller -> PCI function
    is_nvme = name.startswith("nvme")
    return BlockDevice(
        name=name,
        kind=_disk_kind(name, rotational, vendor, model, hypervisor),
        rotational=None if rotational is None else rotational == 1,
        size_bytes=None if sectors is None else sectors * 512,  # /sys counts 512-byte sectors, always
        model=model,
        pcie_gen_current=_pcie_gen(fs, f"{pci}/current_link_speed") if is_nvme else None,
        pcie_gen_max=_pcie_gen(fs, f"{pci}/max_link_speed") if is_nvme else None,
        pcie_width_current=fs.read_int(f"{pci}/current_link_width") if is_nvme else None,
        pcie_width_max=fs.read_int(f"{pci}/max_link_width") if is_nvme else None,
    )


def _disk_kind(name: str, rotational: int | None, vendor: str | None, model: str | None, hypervisor: bool) -> str:
    """nvme | ssd | hdd | virtual.

    "virtual" is a disk whose speed is the hypervisor's or the cloud's, not a drive's: virtio (vd*) and
    Xen (xvd*) by name; md RAID and device-mapper volumes, which sit on other disks; a disk whose vendor
    or model names a hypervisor or a cloud volume (Azure, GCP persistent disk, QEMU, VMware, AWS EBS over
    NVMe); and, in a VM, any disk that claims to spin, because hypervisors report their virtual disks as
    rotational whatever sits underneath and few clouds rent real HDDs.
    """
    if name.startswith(("vd", "xvd", "md", "dm-")):
        return "virtual"
    if vendor in _VIRTUAL_VENDORS or (model or "").startswith(_VIRTUAL_MODELS):
        return "virtual"
    if name.startswith("nvme"):
        return "nvme"
    if rotational == 1:
        return "virtual" if hypervisor else "hdd"
    return "ssd"


def _pcie_gen(fs: SysFs, path: str) -> int | None:
    """'16.0 GT/s PCIe' -> 4: an NVMe drive in a Gen3 or x2 slot caps data loading. 'Unknown' -> None."""
    text = fs.read(path)
    if not text or text.startswith("Unknown"):
        return None
    try:
        return _PCIE_GEN_BY_GTS.get(float(text.split()[0]))
    except ValueError:
        fs.errors.append(f"{path}: {text[:40]!r} is not a link speed")
        return None


# ------------------------------------------------------------------------------------- mounts


def _read_mounts(fs: SysFs) -> list[_MountLine]:
    """Every line of the mount table, the last mount on each mountpoint winning (it hides the others)."""
    text = fs.read("/proc/self/mounts")
    if text is None:
        text = fs.read("/proc/mounts") or ""
    mounts: dict[str, _MountLine] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mountpoint = _unescape(fields[1])
        mounts.pop(mountpoint, None)
        options = fields[3] if len(fields) > 3 else None
        mounts[mountpoint] = _MountLine(_unescape(fields[0]), mountpoint, fields[2], options)
    return list(mounts.values())


def _unescape(field: str) -> str:
    r"""The kernel writes space, tab, newline and backslash in mount paths as octal: '\040' is ' '."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _holds_data(line: _MountLine) -> bool:
    """Real filesystems, plus /dev/shm (the one tmpfs that matters: NCCL and DataLoader use it)."""
    if line.fstype == "tmpfs":
        return line.mountpoint == "/dev/shm"
    if line.mountpoint in ("/proc", "/sys") or line.mountpoint.startswith(("/proc/", "/sys/")):
        return False  # lxcfs and friends: FUSE files standing in for /proc, not storage
    return line.fstype not in _PSEUDO_FSTYPES


def _mount(fs: SysFs, line: _MountLine, statvfs: StatVfs) -> Mount:
    space = _statvfs(fs, line.mountpoint, statvfs)
    return Mount(
        device=line.device,
        mountpoint=line.mountpoint,
        fstype=line.fstype,
        network=_is_network(line),
        fuse=_is_fuse(line),
        options=line.options,
        total_bytes=space.f_blocks * space.f_frsize if space else None,
        free_bytes=space.f_bavail * space.f_frsize if space else None,  # what a non-root user may write
        inodes_total=space.f_files if space else None,
        inodes_free=space.f_ffree if space else None,
        block_device=_base_disk(line.device),
    )


def _is_fuse(line: _MountLine) -> bool:
    return line.fstype == "fuse" or line.fstype.startswith("fuse.")


def _is_network(line: _MountLine) -> bool:
    """A network filesystem, or a FUSE mount of a remote store (sshfs, s3fs, gcsfuse, rclone...)."""
    if line.fstype in _NETWORK_FSTYPES:
        return True
    if not _is_fuse(line):
        return False
    program = line.fstype.removeprefix("fuse.") if line.fstype != "fuse" else line.device
    return program.split("#")[0] in _NETWORK_FUSE


def _base_disk(device: str) -> str | None:
    """'/dev/nvme0n1p1' -> 'nvme0n1', '/dev/sda1' -> 'sda': the disk under a mount, to match /sys/block.
    None for devices that are not a /dev node (overlay, tmpfs, 'server:/export')."""
    if not device.startswith("/dev/") or "/" in device.removeprefix("/dev/"):
        return None
    name = device.removeprefix("/dev/")
    match = re.fullmatch(r"((?:nvme\d+n\d+|mmcblk\d+|md\d+|nbd\d+|loop\d+))p\d+", name)
    match = match or re.fullmatch(r"((?:s|v|xv|h)d[a-z]+)\d+", name)
    return match.group(1) if match else name


def _statvfs(fs: SysFs, mountpoint: str, statvfs: StatVfs) -> os.statvfs_result | None:
    """statvfs with a timeout: a hung network or FUSE mount blocks the call forever, and one stale
    mount must not hang the whole probe. The thread is a daemon, so a stuck one does not block exit."""
    result: list[os.statvfs_result | None] = [None]

    def call() -> None:
        with contextlib.suppress(OSError):
            result[0] = statvfs(mountpoint)

    thread = threading.Thread(target=call, name=f"statvfs {mountpoint}", daemon=True)
    thread.start()
    thread.join(STATVFS_TIMEOUT_S)
    if thread.is_alive():
        fs.errors.append(f"statvfs {mountpoint}: no answer in {STATVFS_TIMEOUT_S:g} s (hung mount?)")
        return None
    return result[0]


# ----------------------------------------------------------------------------------- data paths


def _data_path(path: str, mounts: list[_MountLine]) -> DataPath:
    """The mount holding ``path``: the longest mountpoint that prefixes its real path (symlinks
    resolved, so a link into an NFS share reports the NFS mount)."""
    real = os.path.realpath(path)
    holder = max(
        (line for line in mounts if _is_under(real, line.mountpoint)),
        key=lambda line: len(line.mountpoint),
        default=None,
    )
    return DataPath(
        path=path,
        exists=os.path.exists(path),
        mountpoint=holder.mountpoint if holder else None,
        fstype=holder.fstype if holder else None,
    )


def _is_under(path: str, mountpoint: str) -> bool:
    return mountpoint == "/" or path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")
