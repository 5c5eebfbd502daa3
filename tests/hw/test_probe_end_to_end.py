"""take_snapshot through every probe at once: fake NVML + fake /sys, JSON round trip, then the doctor."""

from __future__ import annotations

import pynvml

from fakes.fake_nvml import HW_THERMAL, FakeProcess, eight_gpu_server
from redline.doctor.engine import run_rules
from redline.hw.probe import take_snapshot
from redline.hw.snapshot import snapshot_from_dict
from redline.units import GiB, MiB
from sysroot import SysRoot, fake_statvfs, statvfs_result

XID_LOG = (
    "[ 1234.5] NVRM: Xid (PCI:0000:58:00): 79, pid=4021, name=python, GPU has fallen off the bus.\n"
    "[ 1300.1] NVRM: Xid (PCI:0000:98:00): 13, Graphics Exception: ESR 0x404600=0x80000002\n"
)


def rented_server(tmp_path) -> SysRoot:
    """A container on an 8-GPU server: powersave governor, docker's 64 MiB /dev/shm, IB port active."""
    root = SysRoot(tmp_path / "root")
    for cpu in range(16):
        root.add_cpu(cpu, model="Intel(R) Xeon(R) Platinum 8480+", governor="powersave")
    root.meminfo(MemTotal=512 * 1024 * 1024, MemAvailable=400 * 1024 * 1024, SwapTotal=0, SwapFree=0)
    root.add_ib_port("mlx5_0", numa_node=0)
    root.write("/proc/sys/net/ipv4/tcp_rmem", "4096 131072 6291456")
    root.write("/proc/sys/net/ipv4/tcp_wmem", "4096 16384 4194304")
    root.write("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5")
    root.write("/sys/bus/pci/devices/0000:18:00.0/numa_node", "garbage")
    root.add_process(4021, "python", uid=1000)  # someone's training job, on GPU 1
    root.mkdir("/dev/shm")
    return root


def test_faulty_server_end_to_end(tmp_path):
    root = rented_server(tmp_path)
    nvml = eight_gpu_server(
        faults={
            3: {"pcie_width": 8, "utilization_pct": 97},
            5: {"clock_event_reasons": HW_THERMAL},
            2: {"ecc_volatile_uncorrected": 4},
            6: {"errors": {"nvmlDeviceGetPowerUsage": RuntimeError("driver returned nonsense")}},
            7: {"errors": {"nvmlDeviceGetEccMode": pynvml.NVMLError_CorruptedInforom()}},
            1: {"processes": [FakeProcess(4021, used_memory=10 * GiB), FakeProcess(99999)]},
        },
        driver="550.54.15",
    )
    statvfs = fake_statvfs({str(root.path("/dev/shm")): statvfs_result(64 * MiB, 64 * MiB)})
    snapshot = take_snapshot(
        fs=root.sysfs(),
        nvml=nvml,
        environ={"NCCL_IB_DISABLE": "1"},
        kernel_log=lambda: XID_LOG,
        statvfs=statvfs,
    )

    # the snapshot survives JSON as `redline probe --json` / `doctor --from` move it
    snapshot = snapshot_from_dict(snapshot.to_dict())
    assert len(snapshot.gpus) == 8
    assert snapshot.host.shm_total_bytes == 64 * MiB
    assert snapshot.gpu.xid_counts == {"13": 1, "79": 1}
    assert snapshot.gpu.xid_by_device == {"0000:58:00": {"79": 1}, "0000:98:00": {"13": 1}}
    assert snapshot.gpus[7].health_errors == {"nvmlDeviceGetEccMode": "CORRUPTED_INFOROM"}
    assert all(not gpu.health_errors for gpu in snapshot.gpus[:7])
    # the process table came from the same fake /proc as the rest of the snapshot
    processes = snapshot.gpus[1].processes or []
    assert [(p.pid, p.name, p.uid) for p in processes] == [(4021, "python", 1000), (99999, None, None)]
    assert snapshot.host.hypervisor is False
    assert snapshot.software.nvidia_open_kernel_module is False
    assert snapshot.gpus[6].power.draw_w is None  # the broken field, and only it, is missing
    assert snapshot.gpus[6].power.enforced_limit_w is not None
    assert any("nvmlDeviceGetPowerUsage" in e for e in snapshot.probe_errors)
    assert any("numa_node" in e and "garbage" in e for e in snapshot.probe_errors)

    report = run_rules(snapshot)
    assert report.rule_errors == []
    found = {(f.rule, f.severity.value, f.subject) for f in report.findings}
    for expected in [
        ("hardware.pcie-link-degraded", "fail", "GPU 3"),
        ("power_thermal.throttled", "fail", "GPU 5"),
        ("gpu_memory.ecc-errors", "fail", "GPU 2"),
        ("hardware.xid", "fail", None),
        ("hardware.xid", "info", None),
        ("network.ib-disabled", "fail", None),
        ("host.shm-small", "fail", None),
        ("host.cpu-governor", "warn", None),
        ("network.tcp-buffers", "warn", None),
    ]:
        assert expected in found, (expected, sorted(found))
    # an 8 x H100 NVML fake with 16 host cores: 2 per GPU
    assert "host.cores-per-gpu" in {f.rule for f in report.findings}
    assert "hardware.identity" not in {f.rule for f in report.findings}


def test_no_driver_is_a_finding_not_a_crash(tmp_path):
    class NoDriver:
        NVMLError = pynvml.NVMLError

        def __getattr__(self, name):
            return getattr(pynvml, name)

        def nvmlInit(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    root = rented_server(tmp_path)
    snapshot = take_snapshot(fs=root.sysfs(), nvml=NoDriver(), environ={}, kernel_log=lambda: None)
    assert not snapshot.gpu.nvml_available
    assert snapshot.gpu.error_code == "driver_not_loaded"
    rules = {f.rule for f in run_rules(snapshot).findings}
    assert "hardware.no-gpu" in rules
    assert snapshot.host.cpu_logical_cores == 16
    assert snapshot.host.memory_total_bytes == 512 * GiB
