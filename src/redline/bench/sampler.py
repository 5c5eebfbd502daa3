"""GPU clocks, power, temperature and clock-event reasons sampled in the background while a bench runs.

A GEMM at 60% of peak means one thing with HW_SLOWDOWN set and another without; every compute and memory
measurement on a GPU carries what this saw. NVML access goes through redline.hw.nvml.
"""

from __future__ import annotations

import threading
from typing import Any


class GpuSampler:
    """`with GpuSampler([0]) as s: work()` then `s.summary()`; a no-op where NVML is unavailable."""

    def __init__(self, indices: list[int], interval_s: float = 0.1) -> None:
        self.indices = indices
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: Any = None

    def __enter__(self) -> GpuSampler:
        from redline.hw.nvml import ClockStateReader

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
        while not self._stop.is_set():
            self.samples.extend(self._reader.read())
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
