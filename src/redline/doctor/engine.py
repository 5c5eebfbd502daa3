"""The rule engine: a registry of rules over one kind of evidence, and the loop that runs them all.

The doctor judges a snapshot (``Audit``), the monitor's diagnosis a window of samples; both keep their rules
in a ``Registry`` whose rules live one module per area in a package (``doctor/rules/``, ``monitor/rules/``),
registered by the ``rule`` decorator when the package is imported, and both get a ``DoctorReport``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic

from redline.doctor.context import Audit
from redline.doctor.model import Area, Evidence, Finding, Rule
from redline.errors import one_line
from redline.hw.snapshot import Snapshot

if TYPE_CHECKING:
    from redline.bench.model import BenchRun


class Registry(Generic[Evidence]):
    """The rules of one engine, by id; ``package`` holds their modules (importing them registers them)."""

    def __init__(self, package: str) -> None:
        self.package = package
        self._rules: dict[str, Rule[Evidence]] = {}

    def rule(
        self, rule_id: str, area: Area, summary: str
    ) -> Callable[[Callable[[Evidence], Iterable[Finding]]], Rule[Evidence]]:
        """Register a check. Its findings get ``rule_id`` and ``area`` stamped on by ``run``."""

        def register(check: Callable[[Evidence], Iterable[Finding]]) -> Rule[Evidence]:
            if rule_id in self._rules:
                raise ValueError(f"duplicate rule id {rule_id!r} in {self.package}")
            registered = Rule(id=rule_id, area=area, summary=summary, check=check)
            self._rules[rule_id] = registered
            return registered

        return register

    def rules(self) -> list[Rule[Evidence]]:
        """Every rule, in area order then id."""
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.package}.{module.name}")
        areas = list(Area)
        return sorted(self._rules.values(), key=lambda r: (areas.index(r.area), r.id))

    def run(self, evidence: Evidence, rules: Iterable[Rule[Evidence]] | None = None) -> DoctorReport:
        """Every rule (or those given) over the evidence. A rule that raises is listed in ``rule_errors``: a
        rule bug must not hide the other rules' findings, nor stop a monitor that runs for days."""
        findings: list[Finding] = []
        errors: list[str] = []
        checked = 0
        for r in self.rules() if rules is None else rules:
            checked += 1
            try:
                findings.extend(replace(f, rule=r.id, area=r.area) for f in r.check(evidence))
            except Exception as exc:
                errors.append(f"rule {r.id} could not run: {one_line(exc)}")
        return DoctorReport(findings=findings, rules_checked=checked, rule_errors=errors)


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


# ------------------------------------------------------------------------------------------ the doctor

DOCTOR: Registry[Audit] = Registry("redline.doctor.rules")
rule = DOCTOR.rule
all_rules = DOCTOR.rules


def run_rules(snapshot: Snapshot, rules: Iterable[Rule] | None = None, bench: BenchRun | None = None) -> DoctorReport:
    """The doctor's rules over a snapshot (and the measurements of a saved bench run)."""
    return DOCTOR.run(Audit(snapshot, bench), rules)
