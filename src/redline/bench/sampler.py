"""GPU clocks, power, temperature and clock-event reasons sampled in the background while a bench runs.

A GEMM at 60% of peak means one thing with HW_SLOWDOWN set and another without; every compute and memory
measurement on a GPU carries what this saw. The GPUs are read through the live reader the monitor uses
(redline.hw.nvml.live), asked for those four only.

A measurement's ``gpu_state`` (``GpuSampler.summary``) is part of the saved bench format, so its keys keep
the units they were saved with: ``sm_mhz_*``, ``power_w_max``, ``temperature_c_max``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from redline.hw.nvml.live import GpuStateReader
from redline.hw.nvml.query import NvmlGone, load_bindings
from redline.hw.sample import GpuSample

# the parts of a GpuSample the bench needs, read ten times a second: nothing that blocks or lists processes
CLOCK_GROUPS = ("clocks", "power", "thermal")


class ClockStateReader:
    """The fast-changing state of some GPUs, read many times while a benchmark runs: one record per GPU
    per ``read`` ({"index", "sm_mhz", "power_w", "temperature_c", "reasons"}, or {"index", "lost"})."""

    def __init__(self, reader: GpuStateReader) -> None:
        self.reader = reader

    @classmethod
    def open(cls, indices: list[int], nvml: Any | None = None) -> ClockStateReader | None:
        """A reader for these GPUs, or None where NVML cannot start (then nothing is sampled)."""
        nvml = nvml or load_bindings()
        if nvml is None:
            return None
        try:
            return cls(GpuStateReader.open(nvml, indices, groups=CLOCK_GROUPS))
        except NvmlGone:
            return None

    def read(self) -> list[dict[str, Any]]:
        """Raises ``NvmlGone`` where NVML stopped answering."""
        return [_record(sample) for sample in self.reader.read(time.monotonic())]

    def close(self) -> None:
        self.reader.close()


def _record(sample: GpuSample) -> dict[str, Any]:
    if sample.lost:
        return {"index": sample.index, "lost": True}
    hertz, celsius = sample.sm_clock_hertz, sample.temperature_celsius
    return {
        "index": sample.index,
        "sm_mhz": None if hertz is None else round(hertz / 1e6),
        "power_w": sample.power_watts,
        "temperature_c": None if celsius is None else round(celsius),
        "reasons": sample.clock_event_reasons,
    }


class GpuSampler:
    """`with GpuSampler([0]) as s: work()` then `s.summary()`; a no-op where NVML is unavailable."""

    def __init__(self, indices: list[int], interval_s: float = 0.1) -> None:
        self.indices = indices
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: ClockStateReader | None = None

    def __enter__(self) -> GpuSampler:
        self._reader = ClockStateReader.open(self.indices)
        if self._reader is not None:
            self._thread = threading.Thread(target=self._run, name="redline-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._reader is not None:
            self._reader.close()

    def _run(self) -> None:
        assert self._reader is not None
        while not self._stop.is_set():
            try:
                self.samples.extend(self._reader.read())
            except NvmlGone:  # the driver went away mid-measurement: keep what was seen until then
                return
            self._stop.wait(self.interval_s)

    def summary(self) -> dict[str, Any]:
        """Per GPU: SM clock min/median/max, peak power and temperature, every clock-event reason seen."""
        out: dict[str, Any] = {}
        for index in self.indices:
            mine = [s for s in self.samples if s["index"] == index]
            if not mine:
                continue
            clocks = sorted(s["sm_mhz"] for s in mine if s.get("sm_mhz") is not None)
            out[str(index)] = {
                "samples": len(mine),
                "sm_mhz_min": clocks[0] if clocks else None,
                "sm_mhz_median": clocks[len(clocks) // 2] if clocks else None,
                "sm_mhz_max": clocks[-1] if clocks else None,
                "power_w_max": max((s["power_w"] for s in mine if s.get("power_w") is not None), default=None),
                "temperature_c_max": max(
                    (s["temperature_c"] for s in mine if s.get("temperature_c") is not None), default=None
                ),
                "clock_event_reasons": sorted({r for s in mine for r in s.get("reasons") or []}),
            }
        return out
