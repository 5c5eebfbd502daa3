"""Can PyTorch run distributed here? torch build, NCCL/gloo, RDMA prerequisites, device ordering."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.units import version_tuple


@rule("distributed.torch-missing", Area.DISTRIBUTED, "PyTorch not installed or not importable")
def torch_missing(audit: Audit) -> Iterator[Finding]:
    software = audit.snapshot.software
    if software.torch is not None:
        return
    error = software.import_errors.get("torch")
    yield Finding(
        Severity.WARN if error else Severity.INFO,
        f"PyTorch cannot be imported: {error}" if error else "PyTorch is not installed in this environment",
        cost="Training needs it, and without it the probe cannot check the CUDA/cuDNN/NCCL versions.",
        fix="Install the PyTorch build matching the driver (https://pytorch.org/get-started/locally/).",
        evidence={"import_error": error},
        command="python -c 'import torch; print(torch.__version__, torch.version.cuda)'",
    )


@rule("distributed.torch-cpu-build", Area.DISTRIBUTED, "GPUs present but PyTorch is a CPU-only build")
def torch_cpu_build(audit: Audit) -> Iterator[Finding]:
    torch = audit.snapshot.software.torch
    if torch is None or not audit.gpus or torch.cuda or torch.hip:
        return
    yield Finding(
        Severity.FAIL,
        f"PyTorch {torch.version} is a CPU-only build on a server with {len(audit.gpus)} GPU(s)",
        cost="Training runs on the CPU and the GPUs sit idle.",
        fix="Reinstall PyTorch from the CUDA index matching the driver, e.g. "
        "pip install torch --index-url https://download.pytorch.org/whl/cu124",
        evidence={"torch": torch.version, "torch_cuda": torch.cuda},
        command="python -c 'import torch; print(torch.version.cuda)'",
    )


@rule("distributed.backends", Area.DISTRIBUTED, "torch.distributed lacks the NCCL or gloo backend")
def backends(audit: Audit) -> Iterator[Finding]:
    torch = audit.snapshot.software.torch
    if torch is None:
        return
    if audit.gpus and torch.cuda and torch.nccl_available is False:
        yield Finding(
            Severity.FAIL,
            "torch.distributed has no NCCL backend",
            cost="Multi-GPU training falls back to gloo: all-reduce through host memory, many times slower.",
            fix="Install an official CUDA build of PyTorch (it bundles NCCL).",
            evidence={"nccl_available": False, "torch": torch.version},
            command="python -c 'import torch.distributed as d; print(d.is_nccl_available())'",
        )
    if torch.gloo_available is False:
        yield Finding(
            Severity.WARN,
            "torch.distributed has no gloo backend",
            cost="CPU collectives (and tools that coordinate ranks on the CPU) cannot run.",
            fix="Install an official PyTorch build; gloo ships with it on Linux.",
            evidence={"gloo_available": False},
            command="python -c 'import torch.distributed as d; print(d.is_gloo_available())'",
        )


@rule("distributed.memlock", Area.DISTRIBUTED, "Locked-memory limit too low for RDMA")
def memlock(audit: Audit) -> Iterator[Finding]:
    limit = audit.snapshot.host.memlock_limit_bytes
    if not audit.snapshot.network.ib_ports or limit is None or limit == -1:
        return
    yield Finding(
        Severity.WARN,
        f"ulimit -l is {limit // 1024} KiB, not unlimited, on a server with InfiniBand/RoCE "
        "(in the shell redline ran in)",
        cost="RDMA must pin (lock) buffers; NCCL fails to register memory or falls back to sockets.",
        fix="Raise it: `ulimit -l unlimited` in the job, LimitMEMLOCK=infinity for services, "
        "`--ulimit memlock=-1` for docker.",
        evidence={"memlock_limit_bytes": limit},
        command="ulimit -l",
    )


@rule("distributed.gpudirect-rdma", Area.DISTRIBUTED, "InfiniBand active but GPUDirect RDMA module not loaded")
def gpudirect_rdma(audit: Audit) -> Iterator[Finding]:
    modules = audit.snapshot.host.loaded_modules
    if not (audit.ib_active and audit.gpus) or modules is None:
        return
    software = audit.snapshot.software
    torch_nccl = software.torch.nccl if software.torch else None
    # the open kernel module with NCCL 2.19+ registers GPU memory through DMA-BUF, no peermem needed;
    # AWS EFA adapters do GPUDirect through their own driver
    dma_buf = software.nvidia_open_kernel_module and torch_nccl and version_tuple(torch_nccl) >= (2, 19)
    efa_only = all(p.device.startswith("efa") for p in audit.snapshot.network.ib_ports if p.state == "ACTIVE")
    if dma_buf or efa_only:
        return
    if not {"nvidia_peermem", "nv_peer_mem"} & set(modules):
        yield Finding(
            Severity.WARN,
            "nvidia_peermem is not loaded: the NIC cannot read GPU memory directly",
            cost="Inter-node traffic is staged through host memory: lower bandwidth and higher latency.",
            fix="modprobe nvidia_peermem (ships with the NVIDIA driver); or switch to the open kernel module "
            "with NCCL 2.19+, which uses DMA-BUF instead.",
            evidence={"ib_active": True, "nvidia_peermem_loaded": False},
            command="lsmod | grep peermem",
        )


@rule("distributed.cuda-device-order", Area.DISTRIBUTED, "CUDA and NVML number the GPUs differently")
def cuda_device_order(audit: Audit) -> Iterator[Finding]:
    if len(audit.gpus) < 2 or audit.env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return
    yield Finding(
        Severity.INFO,
        "CUDA_DEVICE_ORDER is not PCI_BUS_ID: cuda:N may not be nvidia-smi's GPU N",
        cost="Pinning jobs or reading monitoring by index can pick the wrong GPU.",
        fix="export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        evidence={"CUDA_DEVICE_ORDER": audit.env.get("CUDA_DEVICE_ORDER")},
        command="echo $CUDA_DEVICE_ORDER",
    )
