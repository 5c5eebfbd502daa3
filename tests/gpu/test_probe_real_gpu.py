"""The probe against a real NVIDIA driver, cross-checked with nvidia-smi. Skipped where there is no GPU."""

from __future__ import annotations

import subprocess

import pytest

from redline.hw.nvml.probe import probe_gpus

pytestmark = pytest.mark.gpu

FIELDS = "index,name,pci.bus_id,memory.total,driver_version,pcie.link.width.max,power.default_limit,compute_cap"


@pytest.fixture(scope="module")
def smi_rows() -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        pytest.skip(f"nvidia-smi failed: {out.stderr.strip()}")
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines()]


def test_probe_agrees_with_nvidia_smi(smi_rows):
    section = probe_gpus()
    assert section.nvml_available, section.error
    assert len(section.gpus) == len(smi_rows)
    for gpu, (index, name, bus, mem_mib, driver, width_max, power_default, cc) in zip(
        section.gpus, smi_rows, strict=True
    ):
        assert gpu.index == int(index)
        assert gpu.name == name
        assert gpu.pci_bus_id and gpu.pci_bus_id.split(":", 1)[1] == bus.lower().split(":", 1)[1]
        assert gpu.memory_total_bytes == int(mem_mib) * 1024**2
        assert section.driver_version == driver
        assert gpu.pcie.width_max == int(width_max)
        assert gpu.power.default_limit_w == pytest.approx(float(power_default), abs=1)
        assert gpu.compute_capability == cc
        assert not gpu.lost


def test_catalog_knows_this_gpu_and_doctor_runs(smi_rows):
    from redline.doctor.engine import run_rules
    from redline.hw.probe import take_snapshot

    snapshot = take_snapshot()
    report = run_rules(snapshot)
    assert report.rule_errors == []
    assert snapshot.gpus
    assert "hardware.unknown-gpu" not in {f.rule for f in report.findings}
    assert "hardware.identity" not in {f.rule for f in report.findings}
