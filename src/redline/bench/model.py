"""Measurements: plain, JSON-ready records of one benchmark figure each, and the run that holds them."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

BENCH_SCHEMA_VERSION = 1


@dataclass
class Spread:
    """How repeats of one measurement scattered; the reported value is the median."""

    median: float
    p10: float
    p90: float
    minimum: float
    maximum: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)
        return cls(
            median=statistics.median(ordered),
            p10=_quantile(ordered, 0.10),
            p90=_quantile(ordered, 0.90),
            minimum=ordered[0],
            maximum=ordered[-1],
        )


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Measurement:
    """One figure: ``value`` in ``unit``, the median of ``repeats`` timed runs.

    ``peak`` is what it is compared with, in the same unit: a catalog datasheet figure, a theoretical
    link rate, or a peer tool's result (``peak_source`` says which). ``extra`` holds what explains the
    figure: sampled clocks and throttle reasons, per-size rows, correctness counts.
    """

    suite: str
    name: str
    value: float
    unit: str
    method: str
    device: str = "cpu"
    size: dict[str, Any] = field(default_factory=dict)
    repeats: int = 1
    spread: Spread | None = None
    peak: float | None = None
    peak_source: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """value / peak: the share of the reference this machine delivers."""
        return self.value / self.peak if self.peak else None

    @property
    def busy_host(self) -> bool:
        """Whether other processes kept the CPUs busy while this was measured (``extra["host_cpu"]``, recorded
        by ``suites.run_suite``): the figure then understates the machine."""
        host_cpu = self.extra.get("host_cpu")
        return isinstance(host_cpu, dict) and bool(host_cpu.get("busy"))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ratio"] = self.ratio
        return out


@dataclass
class BenchRun:
    """One `redline bench` invocation: where it ran (fingerprint) and what it measured."""

    fingerprint: str
    machine: dict[str, Any]
    taken_at: str
    measurements: list[Measurement] = field(default_factory=list)
    # --quick: small sizes that may not reach the device's peak; the doctor does not judge peaks from them
    quick: bool = False
    schema_version: int = BENCH_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "machine": self.machine,
            "taken_at": self.taken_at,
            "quick": self.quick,
            "measurements": [m.to_dict() for m in self.measurements],
        }
