"""What the doctor produces: findings, each from a rule, each in one of ten areas."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

# what a rule judges: the doctor's Audit of a snapshot, the monitor's Window of samples
Evidence = TypeVar("Evidence")


class Severity(enum.StrEnum):
    FAIL = "fail"  # costs throughput or correctness now; fix before training
    WARN = "warn"  # likely costs throughput; worth fixing
    INFO = "info"  # worth knowing; may be fine for your workload

    @property
    def rank(self) -> int:
        """0 is worst: sort key for 'worst first'."""
        return list(Severity).index(self)


class Area(enum.StrEnum):
    HARDWARE = "hardware"
    MULTI_GPU = "multi_gpu"
    VIRTUALIZATION = "virtualization"
    NETWORK = "network"
    DISTRIBUTED = "distributed"
    STORAGE = "storage"
    GPU_MEMORY = "gpu_memory"
    SOFTWARE = "software"
    POWER_THERMAL = "power_thermal"
    HOST = "host"

    @property
    def heading(self) -> str:
        """The area's name in a report ("GPU memory"); ``title`` is str's own method."""
        return AREA_TITLES[self]


AREA_TITLES = {
    Area.HARDWARE: "Hardware choice and health",
    Area.MULTI_GPU: "Multi-GPU, NVLink and P2P",
    Area.VIRTUALIZATION: "Virtualisation and MIG",
    Area.NETWORK: "Network",
    Area.DISTRIBUTED: "Distributed setup",
    Area.STORAGE: "Storage",
    Area.GPU_MEMORY: "GPU memory",
    Area.SOFTWARE: "Software stack",
    Area.POWER_THERMAL: "Power, thermal and clocks",
    Area.HOST: "Host CPU, memory and NUMA",
}


@dataclass(frozen=True)
class Finding:
    """One thing the doctor found. ``rule`` and ``area`` are filled in by the engine from the rule."""

    severity: Severity
    title: str  # one line: what is wrong, with the key number
    cost: str  # what it costs the user (throughput, stability, money)
    fix: str  # what to do about it
    # the measured values behind it, by name or by GPU index (JSON makes every key a string)
    evidence: dict[Any, Any] = field(default_factory=dict)
    command: str | None = None  # a command that shows it by hand
    subject: str | None = None  # what it is about: "GPU 0-7", "/data", "eth0"
    rule: str = ""
    area: Area | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "area": str(self.area) if self.area else None,
            "severity": str(self.severity),
            "subject": self.subject,
            "title": self.title,
            "evidence": self.evidence,
            "cost": self.cost,
            "fix": self.fix,
            "command": self.command,
        }


@dataclass(frozen=True)
class Rule(Generic[Evidence]):
    """A check over one kind of evidence; its findings get its id and area (see ``engine.Registry``)."""

    id: str  # stable: "area.what" ("monitor.what" for the diagnosis), never renamed once released
    area: Area
    summary: str  # what the rule checks, for --list-rules
    check: Callable[[Evidence], Iterable[Finding]]

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "area": str(self.area), "summary": self.summary}
