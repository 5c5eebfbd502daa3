"""The software stack: Python, torch and how it is configured, the inference runtimes, the environment.

torch is optional and heavy: it is imported only when installed, and the probe never touches anything
that would initialise CUDA (no ``torch.cuda.is_available()``, no ``device_count()``): creating a CUDA
context costs seconds and hundreds of MB on every GPU and can fail on a sick one. Other packages are
looked up in their installed metadata, never imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import redline
from redline.errors import one_line
from redline.hw.snapshot import SoftwareInfo, TorchInfo
from redline.hw.sysfs import SysFs

T = TypeVar("T")

# Distribution names (as pip knows them) of the runtime stack around the GPU.
PACKAGES = (
    "torch",
    "triton",
    "tensorrt",
    "onnxruntime",
    "onnxruntime-gpu",
    "deepspeed",
    "flash-attn",
    "transformer-engine",
    "apex",
    "nvidia-ml-py",
    "vllm",
    "accelerate",
)

# Environment variables that change what the GPU stack does (NCCL_IB_DISABLE, CUDA_VISIBLE_DEVICES...).
_ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "NVIDIA_")
_ENV_NAMES = frozenset({"OMP_NUM_THREADS"})


def probe_software(fs: SysFs, environ: Mapping[str, str] | None = None) -> SoftwareInfo:
    """What runs on the GPUs; ``environ`` defaults to this process's environment."""
    import_errors: dict[str, str] = {}
    return SoftwareInfo(
        python=platform.python_version(),
        platform=platform.platform(),
        redline=redline.__version__,
        torch=_torch_info(import_errors),
        packages=_package_versions(),
        env=_gpu_env(os.environ if environ is None else environ),
        nvidia_kernel_driver=_nvidia_kernel_driver(fs),
        nvidia_open_kernel_module=_nvidia_open_kernel_module(fs),
        import_errors=import_errors,
    )


# -------------------------------------------------------------------------------------- torch


def _torch_info(import_errors: dict[str, str]) -> TorchInfo | None:
    """torch's build and settings, or None where torch is not installed or does not import (the
    one-line reason then goes in ``import_errors``)."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Failed to initialize NumPy", not ours to print
            torch = importlib.import_module("torch")
    except Exception as exc:
        import_errors["torch"] = one_line(exc)
        return None
    return TorchInfo(
        version=str(torch.__version__),
        cuda=_guard(lambda: torch.version.cuda),
        hip=_guard(lambda: torch.version.hip),
        cudnn=_guard(torch.backends.cudnn.version),
        nccl=_guard(lambda: _nccl_version(torch)),
        nccl_available=_guard(lambda: _distributed(torch) and torch.distributed.is_nccl_available()),
        gloo_available=_guard(lambda: _distributed(torch) and torch.distributed.is_gloo_available()),
        matmul_allow_tf32=_guard(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
        cudnn_allow_tf32=_guard(lambda: bool(torch.backends.cudnn.allow_tf32)),
        cudnn_benchmark=_guard(lambda: bool(torch.backends.cudnn.benchmark)),
        float32_matmul_precision=_guard(torch.get_float32_matmul_precision),
    )


def _guard(read: Callable[[], T]) -> T | None:
    """One torch attribute, or None if reading it fails. Warnings are silenced: newer torch warns that
    allow_tf32 is deprecated in favour of fp32_precision, which is noise in a probe's output."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return read()
    except Exception:
        return None


def _nccl_version(torch: Any) -> str | None:
    """(2, 21, 5) -> '2.21.5' (a fourth element is a suffix). CPU builds have no NCCL and raise, which
    ``_guard`` turns into None. Reading the version loads no CUDA context."""
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version[:3]) + "".join(str(part) for part in version[3:])
    return str(version)


def _distributed(torch: Any) -> bool:
    """torch.distributed exists in this build (it is compiled out of some macOS and mobile builds)."""
    return bool(torch.distributed.is_available())


# ----------------------------------------------------------------------------------- packages


def _package_versions() -> dict[str, str]:
    """Installed versions from package metadata: importing tensorrt or vllm just to ask would be slow
    and could touch CUDA."""
    versions: dict[str, str] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _gpu_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that steer NCCL, CUDA, torch and OpenMP, sorted by name."""
    return {
        name: value for name, value in sorted(environ.items()) if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES
    }


def _nvidia_kernel_driver(fs: SysFs) -> str | None:
    """The loaded kernel module's version, which can differ from the user-space driver NVML reports
    (after an upgrade without a reboot, every CUDA call then fails with a version mismatch).
    Both the proprietary ('Kernel Module  550.54.15') and the open ('Open Kernel Module for x86_64
    550.54.15') module say it on the NVRM line."""
    text = fs.read("/proc/driver/nvidia/version")
    match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)*)(?!\S)", text or "")
    return match.group(1) if match else None


def _nvidia_open_kernel_module(fs: SysFs) -> bool | None:
    """Whether the loaded module is the open one ('Open Kernel Module' on the NVRM line): GPUDirect RDMA
    over DMA-BUF needs it, the proprietary module needs nvidia_peermem instead. None without a driver."""
    text = fs.read("/proc/driver/nvidia/version")
    return "Open Kernel Module" in text if text else None
