"""probe_software: torch read without touching CUDA, package versions, the GPU environment, the driver."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

import redline
from redline.hw import software
from redline.hw.software import probe_software
from redline.hw.sysfs import SysFs
from sysroot import SysRoot

PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  (dvs-builder@U16)\n"


@pytest.fixture
def root(tmp_path: Path) -> SysRoot:
    return SysRoot(tmp_path)


def test_software(root: SysRoot) -> None:
    torch = pytest.importorskip("torch")
    root.write("/proc/driver/nvidia/version", PROPRIETARY)
    environ = {
        "NCCL_IB_DISABLE": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": "8",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "HOME": "/root",
        "NCCLX": "not a NCCL variable",
    }

    info = probe_software(root.sysfs(), environ=environ)

    assert info.python == ".".join(str(part) for part in sys.version_info[:3])
    assert info.platform
    assert info.redline == redline.__version__
    assert info.env == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_IB_DISABLE": "1",
        "OMP_NUM_THREADS": "8",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert info.nvidia_kernel_driver == "550.54.15"
    assert info.import_errors == {}
    assert info.torch is not None
    assert info.torch.version == torch.__version__
    assert info.torch.float32_matmul_precision in ("highest", "high", "medium")
    assert isinstance(info.torch.matmul_allow_tf32, bool)
    assert info.packages["torch"] == importlib.metadata.version("torch")
    if torch.version.cuda is None:  # the CPU build this project tests with
        assert (info.torch.cuda, info.torch.cudnn, info.torch.nccl) == (None, None, None)
        assert (info.torch.gloo_available, info.torch.nccl_available) == (True, False)


def test_only_installed_packages_are_listed() -> None:
    packages = probe_software(SysFs("/nonexistent"), environ={}).packages
    for name in software.PACKAGES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            assert name not in packages
        else:
            assert packages[name] == version


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (PROPRIETARY, "550.54.15"),
        (OPEN, "570.124.06"),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05", "535.104.05"),
        ("", None),
    ],
)
def test_nvidia_kernel_driver(root: SysRoot, text: str, version: str | None) -> None:
    root.write("/proc/driver/nvidia/version", text)
    assert probe_software(root.sysfs(), environ={}).nvidia_kernel_driver == version


def test_no_driver_loaded(root: SysRoot) -> None:
    info = probe_software(root.sysfs(), environ={})
    assert (info.nvidia_kernel_driver, info.nvidia_open_kernel_module) == (None, None)


@pytest.mark.parametrize(("text", "is_open"), [(PROPRIETARY, False), (OPEN, True)])
def test_the_open_kernel_module_is_told_from_the_proprietary_one(root: SysRoot, text: str, is_open: bool) -> None:
    root.write("/proc/driver/nvidia/version", text)
    assert probe_software(root.sysfs(), environ={}).nvidia_open_kernel_module is is_open


def test_torch_not_installed(root: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torch" else find_spec(name))
    info = probe_software(root.sysfs(), environ={})
    assert (info.torch, info.import_errors) == (None, {})


def test_torch_that_fails_to_import(root: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    import_module = importlib.import_module

    def broken(name: str, *args: Any) -> Any:
        if name == "torch":
            raise ImportError("libcudart.so.12: cannot open shared object file\nsecond line")
        return import_module(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(importlib, "import_module", broken)
    info = probe_software(root.sysfs(), environ={})
    assert info.torch is None
    assert info.import_errors == {"torch": "ImportError: libcudart.so.12: cannot open shared object file"}


def test_a_failing_or_warning_torch_read_is_contained(root: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")

    def fails() -> str:
        raise RuntimeError("boom")

    def warns() -> int:
        warnings.warn("allow_tf32 is deprecated", UserWarning, stacklevel=1)
        return 90100

    monkeypatch.setattr(torch, "get_float32_matmul_precision", fails)
    monkeypatch.setattr(torch.backends.cudnn, "version", warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = probe_software(root.sysfs(), environ={})
    assert info.torch is not None
    assert (info.torch.float32_matmul_precision, info.torch.cudnn) == (None, 90100)
    assert caught == []


def test_probing_never_asks_cuda(root: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything that would create a CUDA context fails the test if the probe calls it."""
    torch = pytest.importorskip("torch")

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the software probe touched CUDA")

    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    info = probe_software(root.sysfs(), environ={})
    assert info.torch is not None


def test_probing_does_not_initialise_cuda() -> None:
    """In a fresh interpreter, as `redline probe` runs: after the probe, CUDA is still uninitialised."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        from redline.hw.software import probe_software
        from redline.hw.sysfs import SysFs
        info = probe_software(SysFs("/"))
        assert info.torch is not None, info.import_errors
        import torch
        assert not torch.cuda.is_initialized(), "probe_software initialised CUDA"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_this_machine() -> None:
    fs = SysFs("/")
    info = probe_software(fs)
    assert info.python and info.platform and info.redline
    assert all(name.startswith(("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "NVIDIA_", "OMP_")) for name in info.env)
    assert fs.errors == []
