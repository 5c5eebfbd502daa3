"""Is the whole GPU yours? MIG partitions, vGPU slices, compute modes."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity


@rule("virtualization.mig-enabled", Area.VIRTUALIZATION, "MIG mode is on")
def mig_enabled(audit: Audit) -> Iterator[Finding]:
    mig = [g for g in audit.gpus if g.mig_mode]
    if mig:
        yield Finding(
            Severity.WARN,
            "MIG mode is on: work runs in fixed slices of the GPU",
            subject=gpu_subject(mig),
            cost="A process sees one MIG instance (e.g. 1/7 of the SMs and memory), and NCCL cannot span "
            "MIG instances: multi-GPU training does not work across them.",
            fix="For training on whole GPUs ask the provider (or an admin) to disable MIG: nvidia-smi -mig 0.",
            evidence={g.index: g.mig_mode for g in mig},
            command="nvidia-smi -q | grep -i -A2 'MIG Mode'",
        )


@rule("virtualization.vgpu", Area.VIRTUALIZATION, "GPU is a virtual GPU (vGPU) or passed through to a VM")
def vgpu(audit: Audit) -> Iterator[Finding]:
    virtual = [g for g in audit.gpus if g.virtualization_mode == "vgpu"]
    passthrough = [g for g in audit.gpus if g.virtualization_mode == "passthrough"]
    if virtual:
        yield Finding(
            Severity.WARN,
            "GPU is a vGPU: time-sliced or partitioned by the hypervisor",
            subject=gpu_subject(virtual),
            cost="You share the physical GPU: throughput varies with other tenants, and P2P/NVLink, "
            "profiling counters and some NVML fields are unavailable.",
            fix="For dedicated performance ask for a passthrough or bare-metal GPU instance.",
            evidence={"mode": "vgpu"},
            command="nvidia-smi -q | grep -i virtualization",
        )
    if passthrough:
        yield Finding(
            Severity.INFO,
            "GPU is passed through to a virtual machine",
            subject=gpu_subject(passthrough),
            cost="Usually full speed, but P2P between GPUs depends on the hypervisor exposing the PCIe topology.",
            fix="Check the P2P matrix (nvidia-smi topo -p2p r) and the multi_gpu findings of this report.",
            evidence={"mode": "passthrough"},
            command="nvidia-smi topo -m",
        )


@rule("virtualization.compute-mode", Area.VIRTUALIZATION, "GPU compute mode restricts who may use it")
def compute_mode(audit: Audit) -> Iterator[Finding]:
    prohibited = [g for g in audit.gpus if g.compute_mode == "prohibited"]
    exclusive = [g for g in audit.gpus if g.compute_mode and g.compute_mode.startswith("exclusive")]
    if prohibited:
        yield Finding(
            Severity.FAIL,
            "Compute mode PROHIBITED: no process may create a CUDA context",
            subject=gpu_subject(prohibited),
            cost="These GPUs cannot be used at all.",
            fix="An admin sets the default mode: nvidia-smi -i N -c DEFAULT.",
            evidence={g.index: g.compute_mode for g in prohibited},
            command="nvidia-smi --query-gpu=index,compute_mode --format=csv",
        )
    if exclusive:
        yield Finding(
            Severity.INFO,
            "Compute mode EXCLUSIVE_PROCESS: one process per GPU",
            subject=gpu_subject(exclusive),
            cost="Fine for one rank per GPU; a second process (a profiler, an eval job, DataLoader "
            "workers touching CUDA) fails with 'all CUDA-capable devices are busy'.",
            fix="Keep one process per GPU, or ask an admin for DEFAULT mode.",
            evidence={g.index: g.compute_mode for g in exclusive},
            command="nvidia-smi --query-gpu=index,compute_mode --format=csv",
        )
