"""Diagnosis: rules over a window of monitor samples that say what holds a job back, as doctor findings.

The doctor judges one snapshot; a running job has to be judged over time. A GPU drops its clocks for a
second when a kernel ends, a link downshifts while the GPU waits for data, swap sees a burst when a
checkpoint is written: one sample of any of these is noise. So every rule looks at a window (typically
30 to 120 samples, one a second) and raises a finding only for a condition that held for a sustained share
of it, judged only on samples where the condition means something (clocks and links under load, not idle).

Each rule is a small pure function of a ``Window`` (``monitor/window.py``) with a stable id
("monitor.throttling"), an area and a summary, in ``monitor/rules/`` one module per area, registered in
``DIAGNOSIS``, the doctor's rule engine over windows instead of snapshots: ``diagnose`` runs them all and stamps
the rule id and area on every finding, so the doctor's report, JSON and HTML render them unchanged. The
thresholds live in ``DiagnosisConfig``, each with the reason for its value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redline.doctor.engine import DoctorReport, Registry
from redline.doctor.model import Finding, Rule
from redline.monitor.sample import Sample
from redline.monitor.window import DiagnosisConfig, Window

DIAGNOSIS: Registry[Window] = Registry("redline.monitor.rules")
rule = DIAGNOSIS.rule
all_rules = DIAGNOSIS.rules


def diagnose_report(
    window: Sequence[Sample],
    *,
    job_pids: set[int] | None = None,
    config: DiagnosisConfig | None = None,
    rules: Iterable[Rule[Window]] | None = None,
) -> DoctorReport:
    """Every rule over the window, as a doctor report: findings, rules checked, and the rules that crashed."""
    return DIAGNOSIS.run(Window(list(window), config or DiagnosisConfig(), job_pids), rules)


def shortest_window_s(interval_s: float, config: DiagnosisConfig | None = None) -> float:
    """The shortest window in which the rules that judge a duration can say anything: ``min_samples`` readings
    and ``min_duration_s`` of them. A shorter one never yields a finding."""
    config = config or DiagnosisConfig()
    return max(config.min_duration_s, config.min_samples * interval_s)


def diagnose(
    window: Sequence[Sample], *, job_pids: set[int] | None = None, config: DiagnosisConfig | None = None
) -> list[Finding]:
    """The findings of every rule over the window, worst first. ``job_pids`` names the job's processes:
    it decides which GPUs are the job's and which processes are foreign. A rule that crashes is left out
    here; ``diagnose_report`` lists it."""
    return diagnose_report(window, job_pids=job_pids, config=config).sorted()
