"""Is the software stack right for the hardware? Driver vs torch CUDA, library versions, TF32, debug knobs."""

from __future__ import annotations

from collections.abc import Iterator

from redline.doctor.context import Audit, gpu_subject
from redline.doctor.engine import rule
from redline.doctor.model import Area, Finding, Severity
from redline.units import version_tuple

MIN_NCCL = (2, 18)  # 2.18 (2023): NVLS and many hangs fixed; older versions lag on Hopper
MIN_CUDNN = 8900  # 8.9: fused flash attention in cuDNN
SLOW_DEBUG_ENV = {
    "CUDA_LAUNCH_BLOCKING": ("1", "every kernel launch waits for the GPU: no overlap of CPU and GPU work"),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": ("1", "the caching allocator is off: every tensor is a cudaMalloc/cudaFree"),
    "NCCL_DEBUG": ("TRACE", "NCCL logs every call"),
}


@rule("software.driver-mismatch", Area.SOFTWARE, "NVIDIA kernel module and user-space library differ")
def driver_mismatch(audit: Audit) -> Iterator[Finding]:
    section, software = audit.snapshot.gpu, audit.snapshot.software
    nvml_says = section.error_code == "driver_mismatch"
    differ = (
        software.nvidia_kernel_driver
        and section.driver_version
        and software.nvidia_kernel_driver != section.driver_version
    )
    if nvml_says or differ:
        yield Finding(
            Severity.FAIL,
            "NVIDIA driver/library version mismatch"
            + (f": kernel module {software.nvidia_kernel_driver}, NVML {section.driver_version}" if differ else ""),
            cost="CUDA and NVML fail to start: no GPU work is possible.",
            fix="The driver was upgraded without reloading the kernel module: reboot (or unload and reload "
            "the nvidia modules).",
            evidence={
                "nvml_error": section.error,
                "kernel_module": software.nvidia_kernel_driver,
                "nvml_driver": section.driver_version,
            },
            command="cat /proc/driver/nvidia/version; nvidia-smi",
        )


@rule("software.torch-cuda-vs-driver", Area.SOFTWARE, "PyTorch built for a newer CUDA than the driver supports")
def torch_cuda_vs_driver(audit: Audit) -> Iterator[Finding]:
    torch = audit.snapshot.software.torch
    driver_cuda = audit.snapshot.gpu.cuda_driver_version
    if torch is None or not torch.cuda or not driver_cuda:
        return
    built, supported = version_tuple(torch.cuda), version_tuple(driver_cuda)
    if built[:2] <= supported[:2]:
        return
    major_gap = built[0] > supported[0]
    yield Finding(
        Severity.FAIL if major_gap else Severity.WARN,
        f"PyTorch is built for CUDA {torch.cuda}, the driver supports up to CUDA {driver_cuda}",
        cost="Across a major version CUDA does not initialise at all; within one, minor-version "
        "compatibility runs most kernels but PTX JIT and newer features fail.",
        fix="Upgrade the NVIDIA driver, or install a PyTorch build for CUDA <= " + driver_cuda,
        evidence={"torch_cuda": torch.cuda, "driver_cuda": driver_cuda, "driver": audit.snapshot.gpu.driver_version},
        command="nvidia-smi | head -4; python -c 'import torch; print(torch.version.cuda)'",
    )


@rule("software.old-libraries", Area.SOFTWARE, "Old NCCL or cuDNN in the PyTorch build")
def old_libraries(audit: Audit) -> Iterator[Finding]:
    torch = audit.snapshot.software.torch
    if torch is None or not audit.gpus:
        return
    old: dict[str, str | int] = {}
    if torch.nccl and version_tuple(torch.nccl)[:2] < MIN_NCCL:
        old["nccl"] = torch.nccl
    if torch.cudnn and torch.cudnn < MIN_CUDNN:
        old["cudnn"] = torch.cudnn
    if old:
        yield Finding(
            Severity.WARN,
            "Old libraries in this PyTorch: " + ", ".join(f"{k} {v}" for k, v in old.items()),
            cost="Missing newer collective algorithms (NVLS, better tuning) and fused attention kernels; "
            "known hangs fixed since.",
            fix="Upgrade PyTorch (it bundles NCCL and cuDNN), matching the driver's CUDA version.",
            evidence={**old, "torch": torch.version},
            command="python -c 'import torch; print(torch.cuda.nccl.version(), torch.backends.cudnn.version())'",
        )


@rule("software.tf32-off", Area.SOFTWARE, "fp32 matmuls not using TF32 tensor cores on Ampere or newer")
def tf32_off(audit: Audit) -> Iterator[Finding]:
    torch = audit.snapshot.software.torch
    if torch is None or torch.matmul_allow_tf32 is not False or torch.float32_matmul_precision not in (None, "highest"):
        return
    ampere = [g for g in audit.gpus if g.compute_capability and version_tuple(g.compute_capability) >= (8, 0)]
    if not ampere:
        return
    spec = audit.spec(ampere[0])
    speedup = ""
    if spec and spec.peak_tflops.get("tf32") and spec.peak_tflops.get("fp32"):
        fp32, tf32 = spec.peak_tflops["fp32"], spec.peak_tflops["tf32"]
        if tf32 <= fp32:
            return  # GeForce cards run TF32 no faster than fp32: nothing to gain
        speedup = f" (fp32 {fp32:g} vs TF32 {tf32:g} TFLOP/s peak on {spec.key})"
    yield Finding(
        Severity.INFO,
        "TF32 is off by default for fp32 matmuls" + speedup,
        subject=gpu_subject(ampere),
        cost="Models trained in plain fp32 run their matmuls at the fp32 rate, several times below TF32 "
        "(this is PyTorch's default; your script may already change it).",
        fix="torch.set_float32_matmul_precision('high') at the top of the training script, or train in bf16.",
        evidence={
            "matmul_allow_tf32": torch.matmul_allow_tf32,
            "float32_matmul_precision": torch.float32_matmul_precision,
        },
        command="python -c 'import torch; print(torch.get_float32_matmul_precision())'",
    )


@rule("software.persistence-mode", Area.SOFTWARE, "Persistence mode off")
def persistence_mode(audit: Audit) -> Iterator[Finding]:
    off = [g for g in audit.gpus if g.persistence_mode is False]
    if off:
        yield Finding(
            Severity.WARN,
            "Persistence mode is off: the driver unloads the GPU state when no process uses it",
            subject=gpu_subject(off),
            cost="Every job start pays seconds of GPU initialisation, clocks and settings reset between jobs, "
            "and monitoring queries are slow.",
            fix="Run nvidia-persistenced (systemctl enable --now nvidia-persistenced) or nvidia-smi -pm 1.",
            evidence={g.index: False for g in off},
            command="nvidia-smi --query-gpu=index,persistence_mode --format=csv",
        )


@rule("software.debug-env", Area.SOFTWARE, "Debug settings left on that slow training")
def debug_env(audit: Audit) -> Iterator[Finding]:
    env = audit.env
    found = {name: why for name, (value, why) in SLOW_DEBUG_ENV.items() if env.get(name, "").upper() == value}
    if found:
        yield Finding(
            Severity.WARN,
            "Debug settings in the environment: " + ", ".join(f"{k}={env[k]}" for k in found),
            cost="; ".join(found.values()) + ".",
            fix="Unset them outside debugging sessions (check ~/.bashrc, the container image, the job script); "
            "seen in the environment redline ran in.",
            evidence={k: env[k] for k in found},
            command="env | grep -E 'CUDA_LAUNCH_BLOCKING|PYTORCH_NO_CUDA_MEMORY_CACHING|NCCL_DEBUG'",
        )
