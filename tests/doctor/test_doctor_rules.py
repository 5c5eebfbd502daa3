"""Every doctor rule, one fault at a time, on a realistic 8 x H100 server snapshot."""

from __future__ import annotations

import pytest

from builders import H100_MEMORY_BYTES, healthy_server, mutate
from redline.bench.model import BenchRun, Measurement
from redline.doctor.engine import all_rules, run_rules
from redline.doctor.model import Area, Severity
from redline.hw.snapshot import BlockDevice, BusyProcess, CpuBusy, DataPath, GpuProcess, IbPort, Mount, NetInterface
from redline.units import GiB, MiB

F, W, I = Severity.FAIL, Severity.WARN, Severity.INFO  # noqa: E741 (the table reads better)

# (rule id, expected severity, the fault as {dotted path: value}, expected subject or None for "don't care")
# fmt: off
CASES = [
    # hardware
    ("hardware.no-gpu", W, {"gpu.gpus": [], "gpu.nvml_available": False, "gpu.error": "NVML library not found"}, None),
    ("hardware.no-gpu", I, {"gpu.gpus": [], "gpu.p2p": None, "gpu.topology": None, "software.torch.hip": "6.2",
                            "software.torch.cuda": None}, None),
    ("hardware.gpu-lost", F, {"gpu.gpus[5].lost": True}, "GPU 5"),
    ("hardware.nvml-errors", F, {"gpu.gpus[4].health_errors": {"nvmlDeviceGetEccMode": "CORRUPTED_INFOROM"}},
     "GPU 4"),
    ("hardware.unknown-gpu", I, {"gpu.gpus[*].name": "NVIDIA B300 SXM6 AC"}, "GPUs 0-7"),
    ("hardware.identity", F, {"gpu.gpus[2].memory_total_bytes": 40 * GiB}, "GPU 2"),
    ("hardware.identity", F, {"gpu.gpus[2].compute_capability": "8.0"}, "GPU 2"),
    ("hardware.mixed-models", W, {"gpu.gpus[7].name": "NVIDIA A100-SXM4-80GB",
                                  "gpu.gpus[7].compute_capability": "8.0"}, None),
    ("hardware.pcie-link-degraded", F, {"gpu.gpus[3].pcie.width_current": 8, "gpu.gpus[3].utilization_ratio": 0.97},
     "GPU 3"),
    ("hardware.pcie-link-degraded", W, {"gpu.gpus[3].pcie.width_current": 8}, "GPU 3"),
    ("hardware.pcie-link-degraded", I, {"gpu.gpus[3].pcie.gen_current": 1}, "GPU 3"),
    ("hardware.pcie-slot-capped", W, {"gpu.gpus[*].pcie.gen_max": 4, "gpu.gpus[*].pcie.gen_current": 4}, "GPUs 0-7"),
    ("hardware.pcie-replays", W, {"gpu.gpus[6].pcie.replay_count": 5000}, "GPU 6"),
    ("hardware.xid", F, {"gpu.xid_counts": {"79": 1, "48": 2}}, None),
    ("hardware.xid", F, {"gpu.xid_counts": {"79": 1}, "gpu.xid_by_device": {"0000:78:00": {"79": 1}}}, "GPU 3"),
    ("hardware.xid", W, {"gpu.xid_counts": {"63": 2}}, None),
    ("hardware.xid", I, {"gpu.xid_counts": {"13": 4}}, None),
    # multi-GPU
    ("multi_gpu.p2p-unavailable", F, {"gpu.p2p[0][1]": "disabled_by_regkey", "gpu.p2p[1][0]": "disabled_by_regkey"},
     None),
    ("multi_gpu.p2p-unavailable", W, {"gpu.p2p[2][3]": "gpu_not_supported"}, None),
    ("multi_gpu.fabric-not-ready", F, {"gpu.gpus[2].fabric_status": "NVML_ERROR_NVLINK_FABRIC"}, "GPU 2"),
    ("multi_gpu.nvlink-down", F, {"gpu.gpus[4].nvlinks[0].active": False, "gpu.gpus[4].nvlinks[1].active": False},
     "GPU 4"),
    ("multi_gpu.fabric-not-ready", F, {"gpu.gpus[*].fabric_state": "in_progress"}, "GPUs 0-7"),
    ("multi_gpu.cross-socket", W, {"gpu.gpus[*].nvlinks": None}, None),
    ("multi_gpu.pcie-only", I, {"gpu.gpus[*].nvlinks": None}, None),
    # virtualisation
    ("virtualization.mig-enabled", W, {"gpu.gpus[0].mig_mode": True}, "GPU 0"),
    ("virtualization.vgpu", W, {"gpu.gpus[*].virtualization_mode": "vgpu"}, "GPUs 0-7"),
    ("virtualization.vgpu", I, {"gpu.gpus[*].virtualization_mode": "passthrough"}, "GPUs 0-7"),
    ("virtualization.compute-mode", F, {"gpu.gpus[1].compute_mode": "prohibited"}, "GPU 1"),
    ("virtualization.compute-mode", I, {"gpu.gpus[1].compute_mode": "exclusive_process"}, "GPU 1"),
    # network
    ("network.slow-nic", W, {"network.ib_ports": [], "network.interfaces[*].speed_mbps": 1000}, None),
    ("network.slow-nic", I, {"network.ib_ports": [], "network.interfaces[*].speed_mbps": 10_000}, None),
    ("network.ib-port-down", W, {"network.ib_ports[3].state": "DOWN", "network.ib_ports[3].phys_state": "Polling"},
     None),
    ("network.ib-port-down", I, {"network.ib_ports[3].state": "DOWN", "network.ib_ports[3].phys_state": "Disabled"},
     None),
    ("network.ib-disabled", F, {"software.env.NCCL_IB_DISABLE": "1"}, None),
    ("network.ib-disabled", F, {"software.env.NCCL_NET": "Socket"}, None),
    ("network.nccl-env", W, {"software.env.NCCL_P2P_DISABLE": "1"}, None),
    ("network.nccl-env", W, {"software.env.NCCL_SOCKET_IFNAME": "docker0"}, None),
    ("network.roce-mtu", W, {"network.ib_ports": [IbPort("mlx5_0", 1, "ACTIVE", "LinkUp", 200.0, "Ethernet", 0,
                                                          "ens1f0np0")],
                             "network.interfaces": [NetInterface("ens1f0np0", "physical", "up", 200_000, 1500)]},
     None),
    ("network.tcp-buffers", W, {"network.tcp.tcp_rmem_max_bytes": 6 * MiB}, None),
    ("network.congestion-control", I, {"network.tcp.congestion_control": "cubic"}, None),
    ("network.slow-start-after-idle", I, {"network.tcp.slow_start_after_idle": True}, None),
    # distributed
    ("distributed.torch-missing", I, {"software.torch": None}, None),
    ("distributed.torch-missing", W, {"software.torch": None,
                                      "software.import_errors": {"torch": "libcudart.so.12: cannot open"}}, None),
    ("distributed.torch-cpu-build", F, {"software.torch.cuda": None}, None),
    ("distributed.backends", F, {"software.torch.nccl_available": False}, None),
    ("distributed.backends", W, {"software.torch.gloo_available": False}, None),
    ("distributed.memlock", W, {"host.memlock_limit_bytes": 64 * 1024}, None),
    ("distributed.gpudirect-rdma", W, {"host.loaded_modules": ["nvidia", "mlx5_core"]}, None),
    ("distributed.cuda-device-order", I, {"software.env": {}}, None),
    # storage
    ("storage.data-on-network-fs", W, {
        "storage.mounts": [Mount("fs-1:/datasets", "/mnt/datasets", "nfs4", network=True)],
        "storage.data_paths": [DataPath("/mnt/datasets/imagenet", True, "/mnt/datasets", "nfs4")]},
     "/mnt/datasets/imagenet"),
    ("storage.network-mounts", I, {"storage.mounts": [Mount("bucket", "/mnt/s3", "fuse.s3fs", fuse=True)]}, None),
    ("storage.rotational", W, {"storage.block_devices": [BlockDevice("sda", "hdd", True)],
                               "storage.mounts": [Mount("/dev/sda1", "/data", "ext4", block_device="sda")],
                               "storage.data_paths": [DataPath("/data/train", True, "/data", "ext4")]}, "/data/train"),
    ("storage.rotational", W, {"storage.block_devices": [BlockDevice("sda", "hdd", True)]}, None),
    ("storage.disk-full", F, {"storage.mounts[1].free_bytes": 20_000_000_000}, "/data"),
    ("storage.disk-full", W, {"storage.mounts[0].free_bytes": 200_000_000_000}, "/"),
    ("storage.disk-full", W, {"storage.mounts[0].inodes_free": 10_000_000}, "/"),
    ("storage.nvme-link-degraded", W, {"storage.block_devices[1].pcie_width_current": 2}, "nvme1n1"),
    # GPU memory
    ("gpu_memory.ecc-errors", F, {"gpu.gpus[2].ecc.volatile_uncorrected": 3}, "GPU 2"),
    ("gpu_memory.ecc-errors", I, {"gpu.gpus[2].ecc.aggregate_uncorrected": 3}, "GPU 2"),
    ("gpu_memory.ecc-disabled", I, {"gpu.gpus[*].ecc.enabled": False}, "GPUs 0-7"),
    ("gpu_memory.row-remap", F, {"gpu.gpus[6].retirement.remap_failed": True}, "GPU 6"),
    ("gpu_memory.row-remap", F, {"gpu.gpus[6].retirement.remap_pending": True}, "GPU 6"),
    ("gpu_memory.row-remap", W, {"gpu.gpus[6].retirement.retired_pages_double_bit": 50}, "GPU 6"),
    ("gpu_memory.in-use", W, {"gpu.gpus[0].processes": [GpuProcess(4242, "python3", 30 * GiB, uid=1001)]}, "GPU 0"),
    ("gpu_memory.in-use", W, {"gpu.gpus[0].processes": [GpuProcess(4242, None, 30 * GiB, uid=None)]}, "GPU 0"),
    ("gpu_memory.in-use", I, {"gpu.gpus[0].processes": [GpuProcess(4242, "python3", 30 * GiB, uid=1000)]}, "GPU 0"),
    ("gpu_memory.in-use", W, {"gpu.gpus[0].memory_used_bytes": 20 * GiB}, "GPU 0"),
    # software
    ("software.driver-mismatch", F, {"gpu.gpus": [], "gpu.p2p": None, "gpu.topology": None,
                                     "gpu.nvml_available": False, "gpu.error_code": "driver_mismatch",
                                     "gpu.error": "NVML driver/library version mismatch"}, None),
    ("software.driver-mismatch", F, {"software.nvidia_kernel_driver": "550.90.07"}, None),
    ("software.torch-cuda-vs-driver", W, {"software.torch.cuda": "12.6"}, None),
    ("software.torch-cuda-vs-driver", F, {"gpu.cuda_driver_version": "11.8"}, None),
    ("software.old-libraries", W, {"software.torch.nccl": "2.14.3"}, None),
    ("software.old-libraries", W, {"software.torch.cudnn": 8700}, None),
    ("software.tf32-off", I, {"software.torch.float32_matmul_precision": "highest"}, "GPUs 0-7"),
    ("software.persistence-mode", W, {"gpu.gpus[*].persistence_mode": False}, "GPUs 0-7"),
    ("software.debug-env", W, {"software.env.CUDA_LAUNCH_BLOCKING": "1"}, None),
    # power, thermal, clocks
    ("power_thermal.power-capped", W, {"gpu.gpus[*].power.enforced_limit_w": 450.0}, "GPUs 0-7"),
    ("power_thermal.power-capped", I, {"gpu.gpus[*].power.enforced_limit_w": 500.0,
                                       "gpu.gpus[*].power.default_limit_w": 500.0}, "GPUs 0-7"),
    ("power_thermal.throttled", F, {"gpu.gpus[5].clock_event_reasons": ["hw_thermal_slowdown"]}, "GPU 5"),
    ("power_thermal.throttled", F, {"gpu.gpus[5].clock_event_reasons": ["sw_power_cap", "hw_power_brake_slowdown"]},
     "GPU 5"),
    ("power_thermal.power-cap-active", I, {"gpu.gpus[5].clock_event_reasons": ["sw_power_cap"]}, "GPU 5"),
    ("power_thermal.app-clocks", W, {"gpu.gpus[0].clock_event_reasons": ["applications_clocks_setting"],
                                     "gpu.gpus[0].clocks.applications_sm_mhz": 1410}, "GPU 0"),
    ("power_thermal.near-slowdown", W, {"gpu.gpus[7].thermal.temperature_c": 87}, "GPU 7"),
    # host
    ("host.cpu-governor", W, {"host.cpu_governors": {"powersave": 200, "performance": 24}}, None),
    ("host.swap", W, {"host.swap_total_bytes": 8 * GiB, "host.swap_used_bytes": GiB}, None),
    ("host.shm-small", F, {"host.shm_total_bytes": 64 * MiB}, None),
    ("host.cgroup-cpu", W, {"host.cgroup_cpu_limit_cores": 64.0}, None),
    ("host.cores-per-gpu", W, {"host.cgroup_cpu_limit_cores": 16.0}, None),
    ("host.memory-vs-gpu", W, {"host.cgroup_memory_limit_bytes": 256 * GiB}, None),
    ("host.numa-balancing", I, {"host.numa_balancing": True}, None),
    ("host.gpu-nic-numa", I, {"network.ib_ports[*].numa_node": 0}, "GPUs 4-7"),
    ("host.iommu", W, {"host.iommu_mode": "translated"}, None),
    ("host.iommu", W, {"host.iommu_mode": None, "host.kernel_cmdline": "BOOT_IMAGE=/vmlinuz intel_iommu=on"}, None),
    ("host.cpu-busy", W, {"host.cpu_busy": CpuBusy(0.5, 224, 224.0, 180.0, 260.0)}, None),
]
# fmt: on


def test_healthy_server_is_quiet():
    report = run_rules(healthy_server())
    assert report.rule_errors == []
    assert [f.rule for f in report.findings] == ["hardware.capacity"]


@pytest.mark.parametrize(
    ("rule_id", "severity", "fault", "subject"), CASES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_rule_fires_on_its_fault(rule_id, severity, fault, subject):
    report = run_rules(mutate(healthy_server(), fault))
    assert report.rule_errors == []
    hits = [f for f in report.findings if f.rule == rule_id]
    assert hits, f"{rule_id} did not fire; got {[f.rule for f in report.findings]}"
    assert severity in {f.severity for f in hits}
    if subject is not None:
        assert subject in {f.subject for f in hits}
    for f in hits:
        assert f.title and f.cost and f.fix and f.area is not None
        assert f.evidence, f"{rule_id} gives no evidence"


def test_every_rule_is_covered_and_areas_are_all_used():
    rules = all_rules()
    ids = [r.id for r in rules]
    assert len(ids) == len(set(ids))
    assert len(rules) >= 30
    covered = {case[0] for case in CASES} | {case[0] for case in MEASURED} | {"hardware.capacity"}
    assert set(ids) - covered == set(), "rules without a test case"
    assert {r.area for r in rules} == set(Area)
    for r in rules:
        assert r.id.split(".")[0] == r.area.value, f"{r.id} is filed under {r.area}"


def test_capacity_counts_training_and_inference_sizes():
    capacity = next(f for f in run_rules(healthy_server()).findings if f.rule == "hardware.capacity")
    # 16 bytes per parameter for Adam mixed precision: 79.6 GiB / 16 B ~ 5.3B params per GPU, 8x sharded
    assert capacity.evidence["train_params_per_gpu_b"] == pytest.approx(H100_MEMORY_BYTES / 16 / 1e9, rel=1e-3)
    assert capacity.evidence["train_params_sharded_b"] == pytest.approx(8 * H100_MEMORY_BYTES / 16 / 1e9, rel=1e-3)


def test_idle_pcie_downshift_is_not_a_failure():
    report = run_rules(mutate(healthy_server(), {"gpu.gpus[*].pcie.gen_current": 1}))
    severities = {f.severity for f in report.findings if f.rule == "hardware.pcie-link-degraded"}
    assert severities == {I}


def test_a_crashing_rule_does_not_hide_the_others(monkeypatch):
    snapshot = mutate(healthy_server(), {"host.shm_total_bytes": 64 * MiB})
    snapshot.gpu.gpus[0].pcie = None  # data no probe produces: several GPU rules will trip over it
    report = run_rules(snapshot)
    assert report.rule_errors and all("could not run" in e for e in report.rule_errors)
    assert "host.shm-small" in {f.rule for f in report.findings}


def test_findings_sort_worst_first():
    snapshot = mutate(
        healthy_server(), {"host.shm_total_bytes": 64 * MiB, "host.numa_balancing": True, "host.swap_total_bytes": GiB}
    )
    order = [f.severity for f in run_rules(snapshot).sorted()]
    assert order == sorted(order, key=lambda s: s.rank)
    assert order[0] is F


# faults that look alike but are fine: each rule must stay quiet
QUIET = [
    ("network.nccl-env", {"software.env.NCCL_SOCKET_IFNAME": "^lo,docker"}),
    ("distributed.gpudirect-rdma", {"host.loaded_modules": ["nvidia"], "software.nvidia_open_kernel_module": True}),
    ("distributed.gpudirect-rdma", {"host.loaded_modules": ["nvidia"], "network.ib_ports[*].device": "efa_0"}),
    ("host.swap", {"host.swap_total_bytes": 8 * GiB, "host.swap_used_bytes": 0}),
    ("host.iommu", {"host.iommu_mode": None, "host.kernel_cmdline": "intel_iommu=on iommu=pt"}),
    ("power_thermal.app-clocks", {"gpu.gpus[*].clocks.applications_sm_mhz": 1312}),  # V100-style default, no bit
    ("gpu_memory.in-use", {"gpu.gpus[0].processes": [GpuProcess(1, "Xorg", 20 * MiB, "graphics", uid=0)]}),
    ("multi_gpu.p2p-unavailable", {"gpu.p2p[0][7]": "topology_not_supported"}),  # 0 and 7 sit on two sockets
    ("multi_gpu.fabric-not-ready", {"gpu.gpus[*].fabric_status": "success"}),
    ("software.tf32-off", {"software.torch.float32_matmul_precision": "high"}),
    ("host.cpu-busy", {"host.cpu_busy": CpuBusy(0.5, 224, 224.0, 30.0, 31.0)}),  # monitoring agents, a shell
    ("host.cpu-busy", {"host.cpu_busy": CpuBusy(0.5, 224, 8.0, 200.0, 210.0)}),  # a quota of 8: 16 CPUs left
]


@pytest.mark.parametrize(("rule_id", "change"), QUIET, ids=[q[0] for q in QUIET])
def test_rule_stays_quiet_on_a_lookalike(rule_id, change):
    report = run_rules(mutate(healthy_server(), change))
    assert rule_id not in {f.rule for f in report.findings}


def test_disk_full_reports_one_filesystem_once():
    bind_mounts = [
        Mount("/dev/nvme0n1p2", path, "ext4", total_bytes=10**12, free_bytes=10**10, block_device="nvme0n1")
        for path in ("/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/workspace")
    ]
    report = run_rules(mutate(healthy_server(), {"storage.mounts": bind_mounts}))
    hits = [f for f in report.findings if f.rule == "storage.disk-full"]
    assert [f.subject for f in hits] == ["/etc/hosts"]


def test_stock_server_has_no_failures():
    """A healthy server as it ships (distro TCP defaults, swap configured, schedutil, an ssh shell's
    memlock, NCCL_SOCKET_IFNAME excluding lo): advice, but nothing that reads as broken."""
    stock = mutate(
        healthy_server(),
        {
            "network.tcp.congestion_control": "cubic",
            "network.tcp.tcp_rmem_max_bytes": 6 * MiB,
            "network.tcp.tcp_wmem_max_bytes": 4 * MiB,
            "network.tcp.slow_start_after_idle": True,
            "host.swap_total_bytes": 8 * GiB,
            "host.swap_used_bytes": 0,
            "host.cpu_governors": {"performance": 224},
            "software.env": {"NCCL_SOCKET_IFNAME": "^lo,docker"},
            "software.torch.float32_matmul_precision": "highest",
            "network.ib_ports[7].state": "DOWN",
            "network.ib_ports[7].phys_state": "Disabled",
        },
    )
    findings = run_rules(stock).findings
    assert not [f for f in findings if f.severity is F]
    assert {f.rule for f in findings if f.severity is W} == {"network.tcp-buffers"}


def _bench(*measurements: Measurement) -> BenchRun:
    return BenchRun(
        fingerprint="f" * 12, machine={}, taken_at="2026-11-29T12:00:00+00:00", measurements=list(measurements)
    )


def _gemm(value: float, reasons: list[str]) -> Measurement:
    return Measurement(
        "compute",
        "matmul_bf16",
        value,
        "TFLOP/s",
        "torch.matmul",
        device="cuda:0",
        peak=989.4,
        peak_source="catalog H100-SXM5-80GB bf16",
        extra={"gpu_state": {"0": {"clock_event_reasons": reasons}}},
    )


# (rule, severity, the bench run that should trigger it)
MEASURED = [
    ("power_thermal.gemm-below-peak", F, _bench(_gemm(420.0, ["hw_thermal_slowdown"]))),
    ("power_thermal.gemm-below-peak", W, _bench(_gemm(420.0, ["sw_power_cap"]))),
    (
        "hardware.memory-bandwidth-low",
        W,
        _bench(
            Measurement(
                "memory", "h2d_pinned", 6.0, "GB/s", "copy_", device="cuda:0", peak=63.0, peak_source="PCIe Gen5 x16"
            )
        ),
    ),
    (
        "multi_gpu.p2p-bandwidth-low",
        W,
        _bench(Measurement("memory", "p2p_0_1", 9.0, "GB/s", "copy_", peak=450.0, peak_source="NVLink")),
    ),
    (
        "storage.read-throughput-low",
        W,
        _bench(Measurement("storage", "seq_read", 180.0, "MB/s", "preadv O_DIRECT", extra={"path": "/data"})),
    ),
    (
        "storage.read-throughput-low",
        W,
        _bench(
            Measurement("storage", "seq_read", 900.0, "MB/s", "preadv O_DIRECT", extra={"path": "/data"}),
            Measurement(
                "dataloader",
                "samples_per_s",
                8000.0,
                "samples/s",
                "DataLoader",
                extra={"batch_bytes": 64 * 150_528, "batch_size": 64},
            ),
        ),
    ),
    (
        "host.bench-on-busy-host",
        I,
        _bench(
            Measurement(
                "compute",
                "matmul_fp32",
                0.2,
                "TFLOP/s",
                "torch.matmul",
                extra={"host_cpu": {"busy": True, "summary": "other processes kept 1.9 of 2 CPUs busy"}},
            )
        ),
    ),
    (
        "network.streams-needed",
        W,
        _bench(
            Measurement("network", "tcp_1_stream", 6.0, "Mbit/s", "tcp"),
            Measurement("network", "tcp_8_streams", 41.0, "Mbit/s", "tcp"),
        ),
    ),
]


@pytest.mark.parametrize(("rule_id", "severity", "bench"), MEASURED, ids=[m[0] for m in MEASURED])
def test_measured_rule_fires(rule_id, severity, bench):
    report = run_rules(healthy_server(), bench=bench)
    assert report.rule_errors == []
    hits = [f for f in report.findings if f.rule == rule_id]
    assert hits and hits[0].severity is severity and hits[0].evidence


def test_the_busy_bench_rule_gives_the_command_that_measures_those_figures_again():
    """Only the suites measured busy, with the --path their storage figures were taken at: without it the rerun
    would measure the current folder's disk and replace the dataset disk's figures with it."""
    busy = {"host_cpu": {"busy": True, "summary": "other processes kept 1.9 of 2 CPUs busy"}}
    bench = _bench(
        Measurement("compute", "matmul_fp32", 0.2, "TFLOP/s", "torch.matmul", extra=busy),
        Measurement("storage", "seq_read", 90.0, "MB/s", "preadv", extra={**busy, "path": "/mnt/datasets"}),
        Measurement("network", "tcp_1_stream", 90.0, "Mbit/s", "tcp"),
    )
    (finding,) = [f for f in run_rules(healthy_server(), bench=bench).findings if f.rule == "host.bench-on-busy-host"]
    assert finding.command == "redline bench compute storage --path /mnt/datasets --save"
    assert finding.title.startswith("2 saved bench figures were measured while")


def test_measured_rules_are_quiet_on_good_figures_and_without_bench():
    good = _bench(
        _gemm(800.0, ["sw_power_cap"]),
        Measurement("network", "tcp_1_stream", 90.0, "Mbit/s", "tcp"),
        Measurement("network", "tcp_8_streams", 95.0, "Mbit/s", "tcp"),
        Measurement("storage", "seq_read", 2500.0, "MB/s", "preadv"),
    )
    measured = {m[0] for m in MEASURED}
    for bench in (good, None):
        assert not measured & {f.rule for f in run_rules(healthy_server(), bench=bench).findings}


def test_a_busy_host_says_what_is_busy_and_what_to_do():
    """The finding: at load 6 on 2 cores a run took 7.6x longer with the default threads, and nothing said so."""
    busy = CpuBusy(0.5, 2, 2.0, 1.9, 6.1, [BusyProcess(4242, "python3", "alice", 1.0), BusyProcess(77, "cc1plus")])
    (finding,) = [
        f for f in run_rules(mutate(healthy_server(), {"host.cpu_busy": busy})).findings if f.rule == "host.cpu-busy"
    ]
    assert finding.title.startswith("Other processes used 1.9 of 2 CPUs over 0.5 s: 95% of the 2 cores")
    assert "--cpu-threads 1" in finding.fix and "another machine" in finding.fix and "wait" in finding.fix
    assert finding.evidence["busiest"] == ["4242 python3 (alice) 1 cores", "77 cc1plus (?) 0 cores"]
    assert finding.evidence["load_1m"] == 6.1
