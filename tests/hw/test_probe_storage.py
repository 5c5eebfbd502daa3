"""probe_storage against fake /sys/block and /proc/self/mounts trees, and against this machine."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from redline.hw import storage
from redline.hw.snapshot import Mount
from redline.hw.storage import probe_storage
from redline.hw.sysfs import SysFs
from sysroot import SysRoot, fake_statvfs, statvfs_result

GiB = 1 << 30


@pytest.fixture
def root(tmp_path: Path) -> SysRoot:
    return SysRoot(tmp_path / "root")


def by_mountpoint(mounts: list[Mount]) -> dict[str, Mount]:
    return {mount.mountpoint: mount for mount in mounts}


def test_block_devices(root: SysRoot) -> None:
    root.add_block_device(
        "nvme0n1",
        sectors=7_501_476_528,
        model="SAMSUNG MZQL27T6HBLA-00A07",
        link_speed="16.0 GT/s PCIe",
        link_width=4,
        max_link_speed="32.0 GT/s PCIe",
        max_link_width=4,
    )
    root.add_block_device("sda", rotational=1, sectors=2048, model="ST4000NM0035")
    root.add_block_device("sdb", rotational=0)
    root.add_block_device("vda", rotational=1)  # virtio often claims to spin
    root.add_block_device("md0", rotational=0)
    for skipped in ("loop0", "ram0", "zram0", "sr0"):
        root.add_block_device(skipped)

    disks = {disk.name: disk for disk in probe_storage(root.sysfs()).block_devices}

    assert sorted(disks) == ["md0", "nvme0n1", "sda", "sdb", "vda"]
    nvme = disks["nvme0n1"]
    assert (nvme.kind, nvme.rotational, nvme.size_bytes) == ("nvme", False, 7_501_476_528 * 512)
    assert nvme.model == "SAMSUNG MZQL27T6HBLA-00A07"
    assert (nvme.pcie_gen_current, nvme.pcie_width_current, nvme.pcie_gen_max, nvme.pcie_width_max) == (4, 4, 5, 4)
    assert (disks["sda"].kind, disks["sda"].rotational, disks["sda"].size_bytes) == ("hdd", True, 1024 * 1024)
    assert disks["sda"].pcie_gen_current is None
    assert disks["sdb"].kind == "ssd"
    assert (disks["vda"].kind, disks["vda"].rotational) == ("virtual", True)
    assert disks["md0"].kind == "virtual"


@pytest.mark.parametrize(
    ("speed", "gen"), [("2.5 GT/s PCIe", 1), ("8 GT/s", 3), ("64.0 GT/s PCIe", 6), ("Unknown", None)]
)
def test_pcie_generation(root: SysRoot, speed: str, gen: int | None) -> None:
    root.add_block_device("nvme0n1", link_speed=speed)
    fs = root.sysfs()
    assert probe_storage(fs).block_devices[0].pcie_gen_current == gen
    assert fs.errors == []


def test_mounts(root: SysRoot, tmp_path: Path) -> None:
    scratch, datasets = tmp_path / "scratch", tmp_path / "nfs" / "datasets"
    datasets.mkdir(parents=True)
    (datasets / "imagenet").mkdir()
    (tmp_path / "train").symlink_to(datasets / "imagenet")  # a data path reached through a link
    root.add_mount("/dev/nvme0n1p2", "/", "ext4")
    root.add_mount("proc", "/proc", "proc")
    root.add_mount("sysfs", "/sys", "sysfs")
    root.add_mount("cgroup2", "/sys/fs/cgroup", "cgroup2")
    root.add_mount("lxcfs", "/proc/meminfo", "fuse.lxcfs")
    root.add_mount("devpts", "/dev/pts", "devpts")
    root.add_mount("tmpfs", "/run", "tmpfs")
    root.add_mount("shm", "/dev/shm", "tmpfs")
    root.add_mount("/dev/sda1", str(scratch), "xfs")
    root.add_mount("10.0.0.5:/export/datasets", str(datasets), "nfs4", "rw,vers=4.2,rsize=1048576")
    root.add_mount("s3fs", "/mnt/s3 bucket", "fuse.s3fs")
    root.add_mount("/dev/nvme1n1p1", "/mnt/my data", "ext4")
    statvfs = fake_statvfs(
        {
            "/": statvfs_result(1000 * GiB, 400 * GiB),
            "/dev/shm": statvfs_result(64 << 20, 64 << 20),
            str(scratch): statvfs_result(100 * GiB, 0, inodes_total=10, inodes_free=0),  # full
            str(datasets): statvfs_result(50_000 * GiB, 1 * GiB),
            "/mnt/s3 bucket": OSError(107, "Transport endpoint is not connected"),
        }
    )

    assert "/mnt/s3\\040bucket" in root.path("/proc/self/mounts").read_text()  # as the kernel writes it

    fs = root.sysfs()
    info = probe_storage(fs, [str(tmp_path / "train"), str(tmp_path / "nowhere")], statvfs=statvfs)
    mounts = by_mountpoint(info.mounts)

    assert list(mounts) == ["/", "/dev/shm", str(scratch), str(datasets), "/mnt/s3 bucket", "/mnt/my data"]
    rootfs = mounts["/"]
    assert (rootfs.block_device, rootfs.network, rootfs.fuse) == ("nvme0n1", False, False)
    assert (rootfs.total_bytes, rootfs.free_bytes) == (1000 * GiB, 400 * GiB)
    assert mounts["/dev/shm"].total_bytes == 64 << 20
    full = mounts[str(scratch)]
    assert (full.block_device, full.free_bytes, full.inodes_total, full.inodes_free) == ("sda", 0, 10, 0)
    nfs = mounts[str(datasets)]
    assert (nfs.network, nfs.fuse, nfs.block_device, nfs.device) == (True, False, None, "10.0.0.5:/export/datasets")
    assert nfs.options == "rw,vers=4.2,rsize=1048576"
    assert rootfs.options == "rw,relatime"
    s3 = mounts["/mnt/s3 bucket"]
    assert (s3.network, s3.fuse, s3.total_bytes, s3.inodes_free) == (True, True, None, None)
    assert mounts["/mnt/my data"].block_device == "nvme1n1"

    train, nowhere = info.data_paths
    assert (train.path, train.exists, train.mountpoint, train.fstype) == (
        str(tmp_path / "train"),
        True,
        str(datasets),
        "nfs4",
    )
    assert (nowhere.exists, nowhere.mountpoint, nowhere.fstype) == (False, "/", "ext4")
    assert fs.errors == []


def test_the_last_mount_on_a_mountpoint_wins(root: SysRoot) -> None:
    root.add_mount("/dev/sda1", "/data", "ext4")
    root.add_mount("/dev/sdb1", "/data", "xfs")
    (mount,) = probe_storage(root.sysfs(), statvfs=fake_statvfs({})).mounts
    assert (mount.device, mount.fstype, mount.block_device) == ("/dev/sdb1", "xfs", "sdb")


@pytest.mark.parametrize(
    ("device", "fstype", "network", "fuse"),
    [
        ("sshfs#me@host:/data", "fuse", True, True),  # bare 'fuse' names the program in the device...
        ("hdfs", "fuse", True, True),  # ...which is how hdfs and s3fs show up
        ("me@host:/data", "fuse.sshfs", True, True),
        ("bucket", "fuse.mountpoint-s3", True, True),
        ("/dev/sdc1", "fuseblk", False, False),  # ntfs-3g: a local disk
        ("ceph-fuse", "fuse.ceph-fuse", True, True),
        ("//nas/share", "cifs", True, False),
        ("lustre@o2ib:/fs", "lustre", True, False),
        ("overlay", "overlay", False, False),
    ],
)
def test_network_and_fuse(root: SysRoot, device: str, fstype: str, network: bool, fuse: bool) -> None:
    root.add_mount(device, "/data", fstype)
    (mount,) = probe_storage(root.sysfs(), statvfs=fake_statvfs({})).mounts
    assert (mount.network, mount.fuse) == (network, fuse)


@pytest.mark.parametrize(
    ("device", "disk"),
    [
        ("/dev/nvme0n1p1", "nvme0n1"),
        ("/dev/sda1", "sda"),
        ("/dev/xvda1", "xvda"),
        ("/dev/vda", "vda"),
        ("/dev/mmcblk0p2", "mmcblk0"),
        ("/dev/md0", "md0"),
        ("/dev/dm-0", "dm-0"),
        ("/dev/mapper/vg-root", None),
        ("overlay", None),
    ],
)
def test_block_device_under_a_mount(root: SysRoot, device: str, disk: str | None) -> None:
    root.add_mount(device, "/", "ext4")
    (mount,) = probe_storage(root.sysfs(), statvfs=fake_statvfs({})).mounts
    assert mount.block_device == disk


def test_proc_mounts_is_the_fallback(root: SysRoot) -> None:
    root.write("/proc/mounts", "/dev/sda1 / ext4 rw 0 0\n")
    mounts = probe_storage(root.sysfs(), statvfs=fake_statvfs({})).mounts
    assert [(mount.mountpoint, mount.options) for mount in mounts] == [("/", "rw")]


def test_a_mount_line_without_options_has_none(root: SysRoot) -> None:
    root.write("/proc/self/mounts", "/dev/sda1 / ext4\n")
    (mount,) = probe_storage(root.sysfs(), statvfs=fake_statvfs({})).mounts
    assert mount.options is None


@pytest.mark.parametrize(
    ("name", "vendor", "model", "rotational", "kind"),
    [
        ("sda", "Msft", "Virtual Disk", 1, "virtual"),  # Azure / Hyper-V
        ("sdb", "Google", "PersistentDisk", 0, "virtual"),  # GCP persistent disk over SCSI
        ("sdc", "QEMU", "QEMU HARDDISK", 1, "virtual"),  # QEMU SCSI
        ("sdd", "ATA", "QEMU HARDDISK", 0, "virtual"),  # QEMU's emulated SATA: the vendor says ATA
        ("sde", "VMware", "Virtual disk", 1, "virtual"),
        ("sdf", "VMware,", "VMware Virtual S", 1, "virtual"),  # older VMware
        ("nvme1n1", None, "Amazon Elastic Block Store", 0, "virtual"),  # EBS: network storage behind NVMe
        ("nvme2n1", None, "nvme_card-pd", 0, "virtual"),  # GCP persistent disk over NVMe
        ("nvme0n1", None, "Amazon EC2 NVMe Instance Storage", 0, "nvme"),  # AWS local NVMe: a real drive
        ("nvme3n1", None, "nvme_card", 0, "nvme"),  # GCP local SSD
        ("sdg", "ATA", "ST4000NM0035", 1, "hdd"),  # a real SATA HDD on bare metal
        ("sdh", "ATA", "SAMSUNG MZ7LH3T8", 0, "ssd"),
    ],
)
def test_cloud_and_hypervisor_disks_are_virtual(
    root: SysRoot, name: str, vendor: str | None, model: str, rotational: int, kind: str
) -> None:
    root.add_block_device(name, vendor=vendor, model=model, rotational=rotational)
    (disk,) = probe_storage(root.sysfs()).block_devices
    assert disk.kind == kind


@pytest.mark.parametrize(
    ("hypervisor", "rotational", "kind"), [(True, 1, "virtual"), (False, 1, "hdd"), (True, 0, "ssd")]
)
def test_in_a_vm_a_disk_that_claims_to_spin_is_virtual(
    root: SysRoot, hypervisor: bool, rotational: int, kind: str
) -> None:
    """Hypervisors report their virtual disks as rotational whatever sits underneath."""
    flags = "fpu sse sse2 nx lm" + (" hypervisor" if hypervisor else "")
    root.add_cpu(0, flags=flags)
    root.add_block_device("sda", vendor="ATA", model="SomeVendor Disk", rotational=rotational)
    (disk,) = probe_storage(root.sysfs()).block_devices
    assert (disk.kind, disk.rotational) == (kind, rotational == 1)


def test_a_hung_mount_times_out(root: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """statvfs on a dead NFS server never returns; the probe gives up on that mount and goes on."""
    monkeypatch.setattr(storage, "STATVFS_TIMEOUT_S", 0.05)
    root.add_mount("/dev/sda1", "/", "ext4")
    root.add_mount("server:/gone", "/mnt/gone", "nfs")
    released = threading.Event()
    answers = fake_statvfs({"/": statvfs_result(10 * GiB, 5 * GiB)})

    def statvfs(path: str):
        if path == "/mnt/gone":
            released.wait(5)
        return answers(path)

    fs = root.sysfs()
    try:
        mounts = by_mountpoint(probe_storage(fs, statvfs=statvfs).mounts)
    finally:
        released.set()
    assert mounts["/"].total_bytes == 10 * GiB
    assert mounts["/mnt/gone"].total_bytes is None
    assert fs.errors == ["statvfs /mnt/gone: no answer in 0.05 s (hung mount?)"]


def test_an_empty_tree(root: SysRoot) -> None:
    info = probe_storage(root.sysfs(), ["/"], statvfs=fake_statvfs({}))
    assert (info.block_devices, info.mounts) == ([], [])
    assert (info.data_paths[0].exists, info.data_paths[0].mountpoint) == (True, None)


def test_this_machine(tmp_path: Path) -> None:
    fs = SysFs("/")
    info = probe_storage(fs, [str(tmp_path)])
    assert any(mount.mountpoint == "/" for mount in info.mounts) or info.mounts == []
    for mount in info.mounts:
        assert mount.fstype not in ("proc", "sysfs", "cgroup", "cgroup2", "devpts")
        assert mount.total_bytes is None or mount.total_bytes >= 0
    (data,) = info.data_paths
    assert data.exists
    assert data.mountpoint is not None and str(tmp_path.resolve()).startswith(data.mountpoint)
    assert fs.errors == []
