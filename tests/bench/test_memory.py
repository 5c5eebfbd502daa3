"""memory suite: bytes counted the way nvbandwidth/STREAM count them, link peaks, host copy on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from builders import healthy_server
from redline.bench import memory
from redline.bench.context import BenchContext
from redline.errors import BadInput
from redline.hw.snapshot import NvLink, PcieLink
from redline.specs.catalog import find_gpu

MiB = 2**20


def test_copy_counts_read_plus_write_within_a_memory_and_once_across_a_link():
    assert memory.copy_gbs(10**9, 1.0, read_and_write=True) == pytest.approx(2.0)
    assert memory.copy_gbs(10**9, 1.0, read_and_write=False) == pytest.approx(1.0)
    assert memory.copy_gbs(2**30, 0.5, read_and_write=True) == pytest.approx(4 * 2**30 / 1e9)


def test_pcie_per_direction_rates():
    assert memory.pcie_gbs(3, 16) == pytest.approx(15.76)
    assert memory.pcie_gbs(4, 16) == pytest.approx(31.5, rel=1e-3)
    assert memory.pcie_gbs(5, 16) == pytest.approx(63.0, rel=1e-3)
    assert memory.pcie_gbs(4, 8) == pytest.approx(15.75, rel=1e-3)
    assert memory.pcie_gbs(None, 16) is None and memory.pcie_gbs(9, 16) is None


def test_host_copy_on_cpu(monkeypatch):
    monkeypatch.setattr(memory, "HOST_COPY_BYTES", {True: 32 * MiB, False: 32 * MiB})
    measurements = memory.run(BenchContext(quick=True))
    assert [m.name for m in measurements] == ["host_copy"]
    m = measurements[0]
    assert m.unit == "GB/s" and m.value > 0 and m.peak is None and m.device == "cpu"
    assert m.size == {"bytes": 32 * MiB} and "2*size/t" in m.method
    assert m.spread.minimum <= m.value <= m.spread.maximum


def test_pcie_peak_uses_the_max_link_not_the_idle_one():
    gpu = healthy_server(1).gpus[0]
    gpu.pcie = PcieLink(gen_current=1, gen_max=5, width_current=16, width_max=16)  # downshifted at idle
    peak, source, extra = memory._pcie_peak(gpu)
    assert peak == pytest.approx(63.0, rel=1e-3)
    assert "Gen5 x16" in source and "gen_max" in source
    assert extra["pcie"]["gen_current_at_probe"] == 1
    assert memory._pcie_peak(None)[0] is None


def test_p2p_peak_nvlink_through_a_switch_direct_and_pcie():
    gpus = healthy_server(2).gpus
    h100 = find_gpu("h100-sxm")
    # 18 links to NVSwitches: one direction of all of them, 900 GB/s both ways / 2
    peak, source, link = memory.p2p_peak(h100, gpus[0], gpus[1], gpus)
    assert link == "nvlink" and peak == pytest.approx(h100.nvlink_gbs / 2)
    assert "NVSwitch" in source
    # 4 links straight to the other GPU (a bridge): 4 of 18 links
    bridged = dataclasses.replace(gpus[0], nvlinks=[NvLink(i, True, gpus[1].pci_bus_id) for i in range(4)])
    peak, source, link = memory.p2p_peak(h100, bridged, gpus[1], [bridged, gpus[1]])
    assert link == "nvlink" and peak == pytest.approx(4 * h100.nvlink_gbs / h100.nvlink_links / 2)
    # links down: the PCIe rate of the slower GPU
    down = dataclasses.replace(gpus[0], nvlinks=[NvLink(i, False, None) for i in range(18)])
    slow = dataclasses.replace(gpus[1], pcie=PcieLink(gen_max=4, width_max=16))
    peak, source, link = memory.p2p_peak(h100, down, slow, [down, slow])
    assert link == "pcie" and peak == pytest.approx(31.5, rel=1e-3)
    assert memory.p2p_peak(h100, None, gpus[1], gpus) == (None, None, "unknown")


def test_cuda_on_a_machine_without_it_is_bad_input(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(memory, "HOST_COPY_BYTES", {True: MiB, False: MiB})
    with pytest.raises(BadInput, match="cannot use CUDA"):
        memory.run(BenchContext(device="cuda:0", quick=True))
