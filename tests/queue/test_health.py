"""What drains a GPU and what makes a failed job's end a GPU fault's: the monitor's hardware diagnosis over the
daemon's samples of the NVML fake, and the critical Xids of a kernel log."""

from __future__ import annotations

import dataclasses

from fakes.fake_nvml import FakeNvml, h100_sxm
from redline.monitor.sampler import Sampler
from redline.queue.health import GpuHealth, new_xids
from redline.queue.placement import Slot

GPU0_PCI = "0000:18:00.0"
GPU1_PCI = "0000:2a:00.0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def health(nvml: FakeNvml, clock: Clock, log: list[str]) -> GpuHealth:
    sampler = Sampler(nvml=nvml, host=None, kernel_log=lambda: "".join(log), clock=clock, monotonic=clock)
    return GpuHealth(sampler.sample, lambda: "".join(log), window_s=600, interval_s=5, clock=clock)


def two_gpus() -> FakeNvml:
    return FakeNvml([h100_sxm(0, bus_id="00000000:18:00.0"), h100_sxm(1, bus_id="00000000:2A:00.0")])


def slots() -> list[Slot]:
    return [Slot(f"GPU-{i}", i, 80 * 2**30, 0, pci_bus_id=pci) for i, pci in enumerate((GPU0_PCI, GPU1_PCI))]


def test_a_gpu_whose_uncorrectable_ecc_errors_grow_is_drained_for_the_window() -> None:
    nvml, clock = two_gpus(), Clock()
    watch = health(nvml, clock, [])
    watch.observe()
    clock.now += 1
    watch.observe()  # under the interval: no sample
    assert len(watch.samples) == 1 and watch.failing() == {}
    nvml.gpus[1].ecc_volatile_uncorrected = 2
    clock.now += 5
    watch.observe()
    drained = watch.drain(slots())
    assert drained[0].drained == ""
    assert drained[1].drained.startswith("failing: 2 uncorrectable ECC error(s)")
    for _ in range(130):  # ten minutes on, the error has left the window: the GPU takes jobs again
        clock.now += 5
        watch.observe()
    assert watch.failing() == {} and len(watch.samples) <= 121


def test_a_lost_gpu_is_drained_and_an_already_drained_one_keeps_its_reason() -> None:
    nvml, clock = two_gpus(), Clock()
    watch = health(nvml, clock, [])
    watch.observe()
    nvml.gpus[0].lost = True
    clock.now += 5
    watch.observe()
    assert "fell off the bus" in watch.failing()[0] and 1 not in watch.failing()
    probed = [dataclasses.replace(slots()[0], drained="lost"), slots()[1]]
    assert [s.drained for s in watch.drain(probed)] == ["lost", ""]


def test_critical_xids_are_read_per_gpu_and_their_growth_is_told() -> None:
    log = ["NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception\n"]  # an application's fault: not critical
    watch = health(two_gpus(), Clock(), log)
    pci = {"GPU-0": GPU0_PCI, "GPU-1": GPU1_PCI}
    before = watch.critical_xids(pci)
    assert before == {"GPU-0": {}, "GPU-1": {}}
    log.append("NVRM: Xid (PCI:0000:2a:00): 79, pid=1234, GPU has fallen off the bus.\n")
    log.append("NVRM: Xid (PCI:0000:18:00): 31, pid=1234, MMU Fault\n")
    after = watch.critical_xids(pci)
    assert after == {"GPU-0": {}, "GPU-1": {"79": 1}}
    assert new_xids(before, after) == {"GPU-1": ["79"]} and new_xids(after, after) == {}
    unreadable = GpuHealth(lambda: None, lambda: None)  # dmesg refused: nothing known, nothing claimed
    assert unreadable.critical_xids(pci) == {} and new_xids(before, {}) == {}
