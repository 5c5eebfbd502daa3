"""Can the disks feed the GPUs? Network filesystems, rotational disks, full disks, NVMe links."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.hw.snapshot import Mount

FULL_WARN = 0.85
FULL_FAIL = 0.95
# read-only images are full by design
SKIP_FULLNESS = {"squashfs", "iso9660", "erofs"}


def _mount_of(audit: Audit, mountpoint: str | None) -> Mount | None:
    return next((m for m in audit.snapshot.storage.mounts if m.mountpoint == mountpoint), None)


@rule("storage.data-on-network-fs", Area.STORAGE, "Dataset path is on a network or FUSE filesystem")
def data_on_network_fs(audit: Audit) -> Iterator[Finding]:
    for data in audit.snapshot.storage.data_paths:
        mount = _mount_of(audit, data.mountpoint)
        if mount is None or not (mount.network or mount.fuse):
            continue
        yield Finding(
            Severity.WARN,
            f"Data at {data.path} is on {mount.fstype} ({mount.device})",
            subject=data.path,
            cost="Every epoch re-reads over the network: random small-file reads are latency-bound and "
            "GPUs wait on the DataLoader, worse on links far from the data.",
            fix="Stage it to local NVMe: pack it into large shards (WebDataset tar files) and read them through "
            "redline.transfer.stage.Staged, which fetches the next shards into a capped local cache while one "
            "is read (`redline stage add` fills the cache ahead, `redline stage ls` shows it).",
            evidence={"fstype": mount.fstype, "mountpoint": mount.mountpoint, "device": mount.device},
            command=f"findmnt -T {data.path}",
        )


@rule("storage.network-mounts", Area.STORAGE, "Network or FUSE filesystems are mounted")
def network_mounts(audit: Audit) -> Iterator[Finding]:
    if audit.snapshot.storage.data_paths:
        return  # data-on-network-fs answers the precise question
    remote = [m for m in audit.snapshot.storage.mounts if m.network or m.fuse]
    if remote:
        yield Finding(
            Severity.INFO,
            "Network/FUSE filesystems mounted: " + ", ".join(f"{m.mountpoint} ({m.fstype})" for m in remote),
            cost="If your dataset lives there, reads are far slower than local NVMe.",
            fix="Pass your dataset's path: `redline doctor --data PATH` checks where it lives.",
            evidence={m.mountpoint: m.fstype for m in remote},
            command="findmnt -l -o TARGET,FSTYPE,SOURCE | grep -E 'nfs|cifs|smb|ceph|lustre|fuse'",
        )


@rule("storage.rotational", Area.STORAGE, "Data on, or only, rotational disks")
def rotational(audit: Audit) -> Iterator[Finding]:
    storage = audit.snapshot.storage
    kinds = {d.name: d.kind for d in storage.block_devices}
    for data in storage.data_paths:
        mount = _mount_of(audit, data.mountpoint)
        if mount and mount.block_device and kinds.get(mount.block_device) == "hdd":
            yield Finding(
                Severity.WARN,
                f"Data at {data.path} is on a rotational disk ({mount.block_device})",
                subject=data.path,
                cost="A spinning disk gives ~100-200 MB/s sequential and ~100-200 random reads/s: a shuffled "
                "dataset of small files starves the GPUs.",
                fix="Move the dataset to NVMe/SSD, or pack it into large sequential shards.",
                evidence={"device": mount.block_device, "mountpoint": mount.mountpoint},
                command="lsblk -d -o NAME,ROTA,TRAN,MODEL",
            )
    physical = [d for d in storage.block_devices if d.kind != "virtual"]
    if physical and all(d.kind == "hdd" for d in physical) and not storage.data_paths:
        yield Finding(
            Severity.WARN,
            "Only rotational disks: " + ", ".join(d.name for d in physical),
            cost="Local reads are slow (~100-200 MB/s per disk); data loading may bound training.",
            fix="Use a server with local NVMe, or stream large shards from fast object storage.",
            evidence={d.name: d.kind for d in physical},
            command="lsblk -d -o NAME,ROTA,TRAN,MODEL",
        )


@rule("storage.disk-full", Area.STORAGE, "A filesystem is nearly out of space or inodes")
def disk_full(audit: Audit) -> Iterator[Finding]:
    for m in _one_mount_per_filesystem(audit.snapshot.storage.mounts):
        if m.fstype in SKIP_FULLNESS or m.mountpoint == "/dev/shm":
            continue
        used = {}
        if m.total_bytes and m.free_bytes is not None:
            used["space"] = 1 - m.free_bytes / m.total_bytes
        if m.inodes_total and m.inodes_free is not None:
            used["inodes"] = 1 - m.inodes_free / m.inodes_total
        worst = max(used.values(), default=0.0)
        if worst < FULL_WARN:
            continue
        yield Finding(
            Severity.FAIL if worst >= FULL_FAIL else Severity.WARN,
            f"{m.mountpoint} is {worst:.0%} full"
            + (" (inodes)" if used.get("inodes", 0) > used.get("space", 0) else ""),
            subject=m.mountpoint,
            cost="Checkpoint writes fail part-way (a lost run), and caches and logs stop.",
            fix="Free space or point checkpoints, HF_HOME and TMPDIR at a larger volume.",
            evidence={k: round(v, 3) for k, v in used.items()} | {"free_bytes": m.free_bytes, "device": m.device},
            command=f"df -h {m.mountpoint}; df -i {m.mountpoint}",
        )


def _one_mount_per_filesystem(mounts: list[Mount]) -> list[Mount]:
    """Containers bind-mount one filesystem many times (/etc/hosts, /etc/resolv.conf...): keep the
    shortest mountpoint of each device and size, so one full disk is one finding."""
    best: dict[tuple[str, int | None], Mount] = {}
    for m in mounts:
        key = (m.device, m.total_bytes)
        if key not in best or len(m.mountpoint) < len(best[key].mountpoint):
            best[key] = m
    return list(best.values())


@rule("storage.nvme-link-degraded", Area.STORAGE, "NVMe drive's PCIe link below its capability")
def nvme_link_degraded(audit: Audit) -> Iterator[Finding]:
    for d in audit.snapshot.storage.block_devices:
        narrow = d.pcie_width_current and d.pcie_width_max and d.pcie_width_current < d.pcie_width_max
        slow = d.pcie_gen_current and d.pcie_gen_max and d.pcie_gen_current < d.pcie_gen_max
        if narrow or slow:
            yield Finding(
                Severity.WARN,
                f"{d.name} link at Gen{d.pcie_gen_current} x{d.pcie_width_current}, capable of "
                f"Gen{d.pcie_gen_max} x{d.pcie_width_max}",
                subject=d.name,
                cost="Sequential read throughput is capped below what the drive can deliver.",
                fix="Check the slot/riser and BIOS PCIe settings; ask the provider.",
                evidence={
                    "gen": [d.pcie_gen_current, d.pcie_gen_max],
                    "width": [d.pcie_width_current, d.pcie_width_max],
                },
                command=f"cat /sys/block/{d.name}/device/device/current_link_*",
            )
