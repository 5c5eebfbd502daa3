"""The GPUs' health as the queue's daemon follows it: which GPUs to drain, and which failed jobs a GPU fault
ended (those are retried, as a preemption is).

A GPU is drained while the monitor's hardware diagnosis (``monitor.gpu_lost``, ``monitor.ecc_xid_errors``),
run over the daemon's own samples of the last ``WINDOW_S``, fails it: it fell off the bus, or its uncorrectable
ECC errors grew. Each GPU is judged on a window of its own samples, so a finding names no other GPU. A job that
exits non-zero after one of the critical Xids (``kernel_log.CRITICAL_XIDS``: 48 double-bit ECC, 74 NVLink, 79
fell off the bus, 92-95, 119-120 GSP...) appeared on one of its GPUs did not fail by its own fault.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from redline.doctor.model import Severity
from redline.hw.kernel_log import CRITICAL_XIDS, count_xids_by_device, device_xids, read_kernel_log
from redline.monitor.diagnose import diagnose_report
from redline.monitor.rules.hardware import ecc_xid_errors, gpu_lost
from redline.monitor.sample import Sample
from redline.queue.placement import Slot

WINDOW_S = 600.0  # a GPU that failed within the last 10 minutes takes no new job
INTERVAL_S = 5.0  # the daemon samples the GPUs at most this often
RULES = (gpu_lost, ecc_xid_errors)


class GpuHealth:
    """``sample``: a Sample of the GPUs now (the monitor's ``Sampler.sample``, without host or steps);
    ``kernel_log``: the kernel log's text, or None where it cannot be read; ``clock``: the samples' clock."""

    def __init__(
        self,
        sample: Callable[[], Sample],
        kernel_log: Callable[[], str | None] = read_kernel_log,
        window_s: float = WINDOW_S,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sample = sample
        self._clock = clock  # the samples' clock (Sample.time)
        self._kernel_log = kernel_log
        self.window_s = window_s
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque()

    def observe(self) -> None:
        """Take a sample when the last is ``interval_s`` old; forget those older than the window."""
        if self.samples and self._clock() - self.samples[-1].time < self.interval_s:
            return
        sample = self._sample()
        self.samples.append(sample)
        while self.samples and sample.time - self.samples[0].time > self.window_s:
            self.samples.popleft()

    def failing(self) -> dict[int, str]:
        """GPU index -> why it is drained: the title of each failing finding of the hardware rules over its
        samples."""
        indices = sorted({g.index for s in self.samples for g in s.gpus})
        drained = {}
        for index in indices:
            own = [dataclasses.replace(s, gpus=[g for g in s.gpus if g.index == index]) for s in self.samples]
            report = diagnose_report(own, rules=RULES)
            failed = [f.title for f in report.findings if f.severity is Severity.FAIL]
            if failed:
                drained[index] = "; ".join(failed)
        return drained

    def drain(self, slots: Iterable[Slot]) -> list[Slot]:
        """``slots`` with those the diagnosis fails drained (a slot already drained keeps its reason)."""
        failing = self.failing()
        return [
            dataclasses.replace(s, drained=f"failing: {failing[s.index]}")
            if s.index in failing and not s.drained
            else s
            for s in slots
        ]

    def critical_xids(self, pci_bus_ids: Mapping[str, str]) -> dict[str, dict[str, int]]:
        """Device UUID -> the critical Xid codes the kernel log holds for it now, with their counts ({} for a
        GPU without any), for the devices of ``pci_bus_ids`` (UUID -> PCI address); {} where the log cannot be
        read."""
        text = self._kernel_log()
        if text is None:
            return {}
        by_device = count_xids_by_device(text)
        return {
            uuid: {code: n for code, n in device_xids(pci, by_device).items() if int(code) in CRITICAL_XIDS}
            for uuid, pci in pci_bus_ids.items()
        }


def sampled_health(nvml: object | None = None, kernel_log: Callable[[], str | None] = read_kernel_log) -> GpuHealth:
    """The product path: the monitor's sampler over NVML (``nvml``: the bindings, a fake in tests), GPUs only."""
    from redline.monitor.sampler import Sampler

    sampler = Sampler(nvml=nvml, host=None, kernel_log=kernel_log)
    return GpuHealth(sampler.sample, kernel_log)


def new_xids(before: dict[str, dict[str, int]], now: dict[str, dict[str, int]]) -> dict[str, list[str]]:
    """UUID -> the critical Xid codes whose count grew from ``before`` to ``now`` (a device missing from either,
    its log unreadable then, is left out)."""
    grew = {}
    for uuid, codes in now.items():
        if uuid in before:
            new = [code for code, n in codes.items() if n > before[uuid].get(code, 0)]
            if new:
                grew[uuid] = new
    return grew
