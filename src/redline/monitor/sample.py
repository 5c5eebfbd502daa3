"""What `redline monitor` records each interval: one ``Sample`` of every GPU, the host, and the training
steps the runtime finished since the previous sample, on one timeline.

Plain data, JSON-ready (``to_dict``/``from_dict``), shared by the sampler (which fills it), the store (which
keeps it), the exporter and dashboard (which show the newest) and the diagnosis rules (which read windows of
them). Units follow Prometheus's base-unit conventions and are in the field names: bytes, seconds, watts,
joules, hertz, celsius, and ``_ratio`` for a fraction in [0, 1]. ``_total`` fields are counters that only
grow (until the driver or host restarts). ``None`` always means "not available here", never zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from redline.hw.sample import GpuProcess, GpuSample, HostSample


@dataclass
class StepSample:
    """One optimizer step from the runtime's JSON-lines metrics (redline.runtime.metrics.StepRecord)."""

    rank: int
    step: int
    time_s: float
    data_s: float
    compute_s: float
    optimizer_s: float
    comm_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu_catalog: float | None = None
    peak_memory_bytes: int | None = None
    loss: float | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StepSample:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


@dataclass
class Sample:
    time: float  # Unix time, seconds
    gpus: list[GpuSample] = field(default_factory=list)
    host: HostSample | None = None
    steps: list[StepSample] = field(default_factory=list)  # steps finished since the previous sample
    notes: list[str] = field(default_factory=list)  # what could not be read this time, in words

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        return cls(
            time=float(data["time"]),
            gpus=[
                GpuSample(**{**g, "processes": [GpuProcess(**p) for p in g.get("processes") or []]})
                for g in data.get("gpus") or []
            ],
            host=HostSample(**data["host"]) if data.get("host") else None,
            steps=[StepSample(**s) for s in data.get("steps") or []],
            notes=list(data.get("notes") or []),
        )
