"""Snapshots of realistic servers built in code, for doctor tests.

``healthy_server()`` is an 8 x H100 SXM box with nothing wrong: every doctor rule but the informational
capacity summary stays quiet on it. Tests break one thing at a time with ``mutate``. ``TINY_LLAMA`` is a model
config of the same kind: a Hugging Face config.json the plan and workload tests trace.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from redline.hw.snapshot import (
    BlockDevice,
    Gpu,
    GpuClocks,
    GpuEcc,
    GpuPower,
    GpuRetirement,
    GpuSection,
    GpuThermal,
    HostInfo,
    IbPort,
    Mount,
    NetInterface,
    NetworkInfo,
    NumaNode,
    NvLink,
    PcieLink,
    Snapshot,
    SoftwareInfo,
    StorageInfo,
    TcpSettings,
    TorchInfo,
)
from redline.units import GiB, MiB
from redline.workload.profile import TransformerShape

H100_MEMORY_BYTES = 81559 * MiB


def h100(index: int) -> Gpu:
    bus = f"0000:{0x18 + 0x20 * index:02x}:00.0"
    return Gpu(
        index=index,
        name="NVIDIA H100 80GB HBM3",
        uuid=f"GPU-00000000-0000-0000-0000-00000000000{index}",
        pci_bus_id=bus,
        memory_total_bytes=H100_MEMORY_BYTES,
        memory_used_bytes=512 * MiB,
        compute_capability="9.0",
        multiprocessor_count=132,
        persistence_mode=True,
        compute_mode="default",
        mig_mode=False,
        virtualization_mode="none",
        utilization_ratio=0.0,
        clocks=GpuClocks(sm_mhz=1980, sm_max_mhz=1980, memory_mhz=2619, memory_max_mhz=2619, applications_sm_mhz=1980),
        clock_event_reasons=["gpu_idle"],
        power=GpuPower(draw_w=72.0, enforced_limit_w=700.0, default_limit_w=700.0, max_limit_w=700.0),
        thermal=GpuThermal(temperature_c=31, slowdown_c=90, shutdown_c=92),
        pcie=PcieLink(gen_current=5, gen_max=5, gen_gpu_max=5, width_current=16, width_max=16, replay_count=0),
        ecc=GpuEcc(
            enabled=True, volatile_corrected=0, volatile_uncorrected=0, aggregate_corrected=0, aggregate_uncorrected=0
        ),
        retirement=GpuRetirement(
            remapped_rows_correctable=0, remapped_rows_uncorrectable=0, remap_pending=False, remap_failed=False
        ),
        nvlinks=[NvLink(link=i, active=True, peer_pci_bus_id=f"0000:0{i % 4}:00.0") for i in range(18)],
        fabric_state="completed",
        fabric_status="success",
        numa_node=0 if index < 4 else 1,
        cpu_affinity=list(range(0, 56)) if index < 4 else list(range(56, 112)),
        processes=[],
    )


def healthy_server(gpus: int = 8) -> Snapshot:
    n = gpus
    return Snapshot(
        taken_at="2026-11-29T12:00:00+00:00",
        gpu=GpuSection(
            nvml_available=True,
            driver_version="550.54.15",
            cuda_driver_version="12.4",
            nvml_version="12.550.54.15",
            gpus=[h100(i) for i in range(n)],
            p2p=[["self" if i == j else "ok" for j in range(n)] for i in range(n)] if n > 1 else None,
            topology=[
                ["SELF" if i == j else ("NODE" if (i < 4) == (j < 4) else "SYS") for j in range(n)] for i in range(n)
            ]
            if n > 1
            else None,
            xid_counts={},
        ),
        host=HostInfo(
            hostname="gpu-node-17",
            kernel="5.15.0-105-generic",
            os_name="Ubuntu 22.04.4 LTS",
            cpu_model="Intel(R) Xeon(R) Platinum 8480+",
            cpu_logical_cores=224,
            cpu_physical_cores=112,
            cpu_governors={"performance": 224},
            process_cpu_count=224,
            memory_total_bytes=2015 * GiB,
            memory_available_bytes=1900 * GiB,
            swap_total_bytes=0,
            swap_used_bytes=0,
            swappiness=60,
            shm_total_bytes=1007 * GiB,
            shm_free_bytes=1007 * GiB,
            numa_nodes=[
                NumaNode(0, list(range(0, 56)) + list(range(112, 168)), 1007 * GiB),
                NumaNode(1, list(range(56, 112)) + list(range(168, 224)), 1008 * GiB),
            ],
            numa_balancing=False,
            kernel_cmdline="BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p2 ro iommu=pt",
            memlock_limit_bytes=-1,
            iommu_mode="passthrough",
            probe_uid=1000,
            cpu_arch="x86_64",
            hypervisor=False,
            loaded_modules=["nvidia", "nvidia_uvm", "nvidia_peermem", "mlx5_core", "mlx5_ib"],
        ),
        storage=StorageInfo(
            block_devices=[
                BlockDevice("nvme0n1", "nvme", False, 3_840_000_000_000, "SAMSUNG MZQL23T8HCLS", 4, 4, 4, 4),
                BlockDevice("nvme1n1", "nvme", False, 3_840_000_000_000, "SAMSUNG MZQL23T8HCLS", 4, 4, 4, 4),
            ],
            mounts=[
                Mount(
                    "/dev/nvme0n1p2",
                    "/",
                    "ext4",
                    total_bytes=1_900_000_000_000,
                    free_bytes=1_200_000_000_000,
                    inodes_total=100_000_000,
                    inodes_free=90_000_000,
                    block_device="nvme0n1",
                ),
                Mount(
                    "/dev/nvme1n1",
                    "/data",
                    "xfs",
                    total_bytes=3_840_000_000_000,
                    free_bytes=2_000_000_000_000,
                    inodes_total=200_000_000,
                    inodes_free=190_000_000,
                    block_device="nvme1n1",
                ),
                Mount("tmpfs", "/dev/shm", "tmpfs", total_bytes=1007 * GiB, free_bytes=1007 * GiB),
            ],
        ),
        network=NetworkInfo(
            interfaces=[
                NetInterface("lo", "loopback", "unknown", None, 65536),
                NetInterface("eno1", "physical", "up", 100_000, 1500, 0, "ice"),
                *[NetInterface(f"ibp{i}s0", "physical", "up", 400_000, 4092, i // 4, "mlx5_core") for i in range(8)],
            ],
            ib_ports=[IbPort(f"mlx5_{i}", 1, "ACTIVE", "LinkUp", 400.0, "InfiniBand", i // 4) for i in range(8)],
            tcp=TcpSettings(
                congestion_control="bbr",
                available_congestion_control=["reno", "cubic", "bbr"],
                rmem_max_bytes=64 * MiB,
                wmem_max_bytes=64 * MiB,
                tcp_rmem_max_bytes=64 * MiB,
                tcp_wmem_max_bytes=64 * MiB,
                window_scaling=True,
                slow_start_after_idle=False,
                default_qdisc="fq",
            ),
        ),
        software=SoftwareInfo(
            python="3.11.9",
            platform="Linux-5.15.0-105-generic-x86_64-with-glibc2.35",
            redline="0.1.0",
            torch=TorchInfo(
                version="2.5.1+cu124",
                cuda="12.4",
                cudnn=90100,
                nccl="2.21.5",
                nccl_available=True,
                gloo_available=True,
                matmul_allow_tf32=False,
                cudnn_allow_tf32=True,
                cudnn_benchmark=False,
                float32_matmul_precision="high",
            ),
            env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            nvidia_kernel_driver="550.54.15",
            nvidia_open_kernel_module=False,
        ),
    )


def mutate(snapshot: Snapshot, changes: dict[str, Any]) -> Snapshot:
    """A copy with each dotted path set: {"gpu.gpus[3].pcie.width_current": 8, "gpu.gpus[*].mig_mode": True}.

    ``[*]`` sets the field on every element; a mapping key path ends in ``.env.NAME``.
    """
    out = copy.deepcopy(snapshot)
    for path, value in changes.items():
        _set(out, path, value)
    return out


def _set(root: Any, path: str, value: Any) -> None:
    *steps, last = re.findall(r"[^.\[\]]+|\[\d+\]|\[\*\]", path)
    targets = [root]
    for token in steps:
        targets = [child for t in targets for child in _children(t, token)]
    for t in targets:
        if last.startswith("["):
            t[int(last[1:-1])] = value
        elif isinstance(t, dict):
            t[last] = value
        elif not hasattr(t, last):
            raise AttributeError(f"{type(t).__name__} has no field {last!r} (path {path})")
        else:
            setattr(t, last, value)


def _children(obj: Any, token: str) -> list[Any]:
    if token == "[*]":
        return list(obj)
    if token.startswith("["):
        return [obj[int(token[1:-1])]]
    return [obj[token] if isinstance(obj, dict) else getattr(obj, token)]


# a TinyLlama-shaped Hugging Face config.json, small enough to trace in a moment (tests of reading model configs)
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "vocab_size": 1000,
}


def megatron_gpt(hidden: int, layers: int, heads: int, *, residual_bytes: int | None = None) -> TransformerShape:
    """A GPT as Megatron-LM's papers size it (Narayanan et al. 2021, Korthikanti et al. 2022): a 4h MLP, a 51,200
    vocabulary, 2,048 learned positions, dropout; ``residual_bytes=2`` plans Megatron's bf16 residual stream, None
    the stream redline's runtime keeps."""
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=4 * hidden,
        vocab=51200,
        seq_len=2048,
        position_embeddings=2048,
        residual_bytes=residual_bytes,
    )
