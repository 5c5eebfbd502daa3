"""The rule registry and the loop that runs every rule over a snapshot."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from redline.doctor.context import Audit
from redline.doctor.model import Area, Finding, Rule
from redline.hw.snapshot import Snapshot

if TYPE_CHECKING:
    from redline.bench.model import BenchRun

_RULES: dict[str, Rule] = {}


def rule(rule_id: str, area: Area, summary: str) -> Callable[[Callable[[Audit], Iterable[Finding]]], Rule]:
    """Register a check. Its findings get ``rule_id`` and ``area`` stamped on by the engine."""

    def register(check: Callable[[Audit], Iterable[Finding]]) -> Rule:
        if rule_id in _RULES:
            raise ValueError(f"duplicate doctor rule id {rule_id!r}")
        registered = Rule(id=rule_id, area=area, summary=summary, check=check)
        _RULES[rule_id] = registered
        return registered

    return register


def all_rules() -> list[Rule]:
    """Every rule, in area order then id; importing the rules package registers them."""
    import redline.doctor.rules as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    areas = list(Area)
    return sorted(_RULES.values(), key=lambda r: (areas.index(r.area), r.id))


@dataclass
class DoctorReport:
    findings: list[Finding]
    rules_checked: int
    # a rule that crashed on unexpected data: the report is still produced without it
    rule_errors: list[str] = field(default_factory=list)

    def sorted(self) -> list[Finding]:
        """Worst first, then by area and rule, so a screen shows what matters most at the top."""
        areas = list(Area)
        return sorted(
            self.findings,
            key=lambda f: (f.severity.rank, areas.index(f.area) if f.area else 0, f.rule, f.subject or ""),
        )

    def grouped(self) -> list[tuple[Area, list[Finding]]]:
        """Findings by area: the area with the worst finding first, each area's findings worst first."""
        groups: dict[Area, list[Finding]] = {}
        for f in self.sorted():  # worst first, so each area's first finding is its worst
            groups.setdefault(f.area or Area.HARDWARE, []).append(f)
        return sorted(groups.items(), key=lambda item: (item[1][0].severity.rank, list(Area).index(item[0])))

    def counts(self) -> dict[str, int]:
        out = {"fail": 0, "warn": 0, "info": 0}
        for f in self.findings:
            out[str(f.severity)] += 1
        return out


def run_rules(snapshot: Snapshot, rules: Iterable[Rule] | None = None, bench: BenchRun | None = None) -> DoctorReport:
    audit = Audit(snapshot, bench)
    findings: list[Finding] = []
    errors: list[str] = []
    checked = 0
    for r in all_rules() if rules is None else rules:
        checked += 1
        try:
            findings.extend(replace(f, rule=r.id, area=r.area) for f in r.check(audit))
        except Exception as exc:  # a rule bug must not hide the other 40 rules' findings
            errors.append(f"rule {r.id} could not run: {type(exc).__name__}: {exc}")
    return DoctorReport(findings=findings, rules_checked=checked, rule_errors=errors)
