"""Diagnosis: rules over a window of monitor samples that say what holds a job back, as doctor findings.

The doctor judges one snapshot; a running job has to be judged over time. A GPU drops its clocks for a
second when a kernel ends, a link downshifts while the GPU waits for data, swap sees a burst when a
checkpoint is written: one sample of any of these is noise. So every rule here looks at a window (typically
30 to 120 samples, one a second) and raises a finding only for a condition that held for a sustained share
of it, judged only on samples where the condition means something (clocks and links under load, not idle).

Each rule is a small pure function of a ``Window`` registered in ``RULES`` with a stable id
("monitor.throttling"), an area and a summary, as the doctor's are; ``diagnose`` runs them all and stamps
the rule id and area on every finding, so the doctor's report, JSON and HTML render them unchanged. The
thresholds live in ``DiagnosisConfig``, each with the reason for its value.

A field that is ``None`` ("not available here", see ``redline.monitor.sample``) is never evidence either
way: a sample without it is left out of that rule's count, and a window with too few usable samples (or too
short) raises nothing from the rules that need a duration.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import pairwise
from typing import Any

from redline.doctor.engine import DoctorReport
from redline.doctor.model import Area, Finding, Severity
from redline.doctor.rules.power_thermal import HARDWARE_THROTTLE
from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample
from redline.units import GiB, MiB, fmt_bytes, fmt_duration, fmt_index_list

# Clock-event reasons that are not throttling. gpu_idle: clocks drop because nothing runs.
# applications_clocks_setting and display_clock_setting: the clocks sit where a setting puts them (the
# doctor's power_thermal.app-clocks judges a low setting from the snapshot). sync_boost: the GPU follows the
# slowest member of its sync-boost group, whose own reason bit names the cause.
NOT_THROTTLING = frozenset({"gpu_idle", "applications_clocks_setting", "display_clock_setting", "sync_boost"})
POWER_CAP = "sw_power_cap"
# hardware protecting itself (heat, power delivery): the doctor's list, with its descriptions
HARDWARE_REASONS = frozenset(HARDWARE_THROTTLE)
OTHER_REASON_TEXT = {
    "board_limit": "a board-level clock limit",
    "reliability": "a reliability voltage limit",
}

# usable bandwidth per PCIe lane and direction after line encoding, GB/s (PCI-SIG: 8b/10b up to Gen2,
# 128b/130b from Gen3; Gen6's FLIT mode is counted at its raw rate)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass(frozen=True)
class DiagnosisConfig:
    """Thresholds of the diagnosis rules. The defaults suit a training job sampled once a second."""

    # --- what a window must hold before a rule that needs a duration may judge it
    # ten readings at least: with fewer, one odd sample is 10%+ of the evidence
    min_samples: int = 10
    # and ten seconds: at a 5 s interval ten samples is enough; at 0.1 s, one second of anything is noise
    min_duration_s: float = 10.0
    # "sustained": the condition held in at least this share of the samples that could show it
    sustained_fraction: float = 0.6

    # --- load. NVML utilisation is the share of the sample period in which any kernel ran, not SM
    # occupancy: a training loop keeps it at 90-100%, so half the time is a loose, safe "under load".
    busy_utilization: float = 0.5
    # a GPU below this for the whole window runs nothing worth mentioning (monitoring tools poke it)
    idle_utilization: float = 0.05
    # a GPU above this on average takes part in something (an input-bound job may sit at 20-40%)
    in_use_utilization: float = 0.1

    # --- clocks. Throttling is judged only under load: idle GPUs drop their clocks legitimately.
    # Hardware slowdown (heat, power brake) is never normal, so a fifth of the loaded time is enough.
    hardware_throttle_fraction: float = 0.2
    # the power cap is normal on dense matmuls at full TDP: only a sustained cap is worth saying
    power_cap_fraction: float = 0.6
    # at the cap, an H100 on dense bf16 GEMMs holds ~85-90% of its max SM clock; well below means a cap
    # that costs real speed (a lowered limit, a hot or inefficient board)
    power_cap_clock_ratio: float = 0.75
    # enforced limits are rounded by the driver; a GPU more than 2% below its peers' limit was lowered
    power_limit_peer_tolerance: float = 0.98

    # --- GPU memory: at 95% the allocator has little headroom left for a spike or fragmentation
    memory_full_ratio: float = 0.95

    # --- stragglers across the GPUs of one job
    min_job_gpus: int = 3  # "lower than the median of the others" needs at least two others
    # a synchronous job keeps every rank's GPU near 100% (NCCL kernels spin while waiting), so a rank
    # 20 points below the others leaves its GPU idle for part of every step
    straggler_utilization_gap: float = 0.2
    # identical GPUs under the same load boost within a few percent of each other; 10% lower is a cause
    straggler_clock_ratio: float = 0.9
    # step data: a rank whose own work (data + compute + optimizer) takes 15% longer than the others' median,
    # step after step; ranks of one job differ by a few percent from sequence lengths and kernel jitter
    straggler_step_ratio: float = 1.15
    # ... and the others spend at least half of that excess waiting (exposed communication or time
    # outside their phases): then the job is synchronous and runs at the straggler's pace
    straggler_wait_share: float = 0.5
    min_steps: int = 5  # steps per rank (and in all) before step data is judged

    # --- input-bound
    # a fifth of each step waiting for the next batch: the GPU idles for that fifth
    input_data_share: float = 0.2
    # half of each step waiting: the job runs at half speed or less, fix it before anything else
    input_data_share_fail: float = 0.5
    # without step data: GPUs of the job running kernels at most 60% of the time ...
    input_gpu_utilization_max: float = 0.6
    # ... while the host's CPUs (all cores together) are nearly saturated, or wait on I/O
    host_cpu_saturated: float = 0.85
    host_iowait_high: float = 0.2

    # --- GPU memory held outside the job, or on an idle GPU: smaller than 1 GiB is a CUDA context
    # (300-500 MiB) or a display server, which costs nothing worth reporting
    holder_bytes: int = 1 * GiB

    # --- host swap: 1 MiB/s is 256 pages a second going to or from disk, far above the trickle of
    # idle pages a healthy host swaps out, and the swapping must hold for 30% of the window, so a burst
    # (a checkpoint written through the page cache) does not count
    swap_bytes_per_second: float = 1 * MiB
    swap_fraction: float = 0.3

    # --- errors: a few corrected ECC errors are background; a stream of them in one window points at a
    # weak memory row that the GPU will remap at its next reset
    ecc_corrected_info: int = 10


# ------------------------------------------------------------------------------------------ the window


@dataclass
class Window:
    """The samples a diagnosis judges, in time order, with the lookups every rule would otherwise redo."""

    samples: list[Sample]
    config: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    # pids of the job's processes, as NVML reports them (same PID namespace as the sampler's)
    job_pids: set[int] | None = None

    def __post_init__(self) -> None:
        self.samples = sorted(self.samples, key=lambda s: s.time)

    @cached_property
    def interval_s(self) -> float:
        """The sampling interval: the median gap between samples (robust to one late sample); 0 if unknown."""
        gaps = [b.time - a.time for a, b in pairwise(self.samples) if b.time > a.time]
        return statistics.median(gaps) if gaps else 0.0

    def seconds(self, count: int) -> float:
        """The time ``count`` samples cover."""
        return count * self.interval_s

    def sustained(self, count: int) -> bool:
        """Whether ``count`` usable samples are enough evidence (in number and in time) to judge at all."""
        return count >= self.config.min_samples and self.seconds(count) >= self.config.min_duration_s

    @cached_property
    def rows(self) -> list[dict[int, GpuSample]]:
        """Each sample's readable (not lost) GPUs by index: what rules compare across GPUs at one instant."""
        return [{g.index: g for g in s.gpus if not g.lost} for s in self.samples]

    @cached_property
    def gpus(self) -> dict[int, list[GpuSample]]:
        """Each GPU's readable samples, in time order."""
        out: dict[int, list[GpuSample]] = {}
        for row in self.rows:
            for index, g in row.items():
                out.setdefault(index, []).append(g)
        return dict(sorted(out.items()))

    @cached_property
    def hosts(self) -> list[HostSample]:
        return [s.host for s in self.samples if s.host is not None]

    @cached_property
    def steps(self) -> list[StepSample]:
        return [st for s in self.samples for st in s.steps]

    def loaded(self, index: int) -> list[GpuSample]:
        """This GPU's samples under load: the only ones where clocks and link speed say anything."""
        busy = self.config.busy_utilization
        return [g for g in self.gpus.get(index, []) if g.utilization_ratio is not None and g.utilization_ratio >= busy]

    def mean_utilization(self, index: int) -> float | None:
        return _mean(g.utilization_ratio for g in self.gpus.get(index, []))

    @cached_property
    def pid_gpus(self) -> set[int]:
        """GPUs on which one of ``job_pids`` holds memory at some point in the window. Empty when no job pid
        shows up at all (pids of another PID namespace, or a job that has not touched a GPU yet): then the
        window cannot tell the job's processes from anyone else's."""
        if not self.job_pids:
            return set()
        return {i for i, series in self.gpus.items() for g in series for p in g.processes if p.pid in self.job_pids}

    def job_gpus(self, min_utilization: float) -> list[int]:
        """The GPUs of the job: those running a job process when ``job_pids`` is given and any of them shows
        up on a GPU; otherwise those whose mean utilisation reaches ``min_utilization``."""
        if self.pid_gpus:
            return sorted(self.pid_gpus)
        return [i for i in self.gpus if (u := self.mean_utilization(i)) is not None and u >= min_utilization]


# ------------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class MonitorRule:
    """A diagnosis rule, as the doctor's ``Rule`` but over a ``Window`` instead of a snapshot."""

    id: str  # stable: "monitor.what", never renamed once released
    area: Area
    summary: str  # what the rule checks, for a rule listing
    check: Callable[[Window], Iterable[Finding]]

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "area": str(self.area), "summary": self.summary}


RULES: list[MonitorRule] = []


def rule(rule_id: str, area: Area, summary: str) -> Callable[[Callable[[Window], Iterable[Finding]]], MonitorRule]:
    """Register a diagnosis rule; ``diagnose`` stamps ``rule_id`` and ``area`` on its findings."""

    def register(check: Callable[[Window], Iterable[Finding]]) -> MonitorRule:
        if any(r.id == rule_id for r in RULES):
            raise ValueError(f"duplicate monitor rule id {rule_id!r}")
        registered = MonitorRule(id=rule_id, area=area, summary=summary, check=check)
        RULES.append(registered)
        return registered

    return register


def diagnose_report(
    window: Sequence[Sample],
    *,
    job_pids: set[int] | None = None,
    config: DiagnosisConfig | None = None,
    rules: Iterable[MonitorRule] | None = None,
) -> DoctorReport:
    """Every rule over the window, as a doctor report: findings, rules checked, and the rules that crashed
    (a rule bug must not hide the other rules' findings, nor stop a monitor that runs for days)."""
    w = Window(list(window), config or DiagnosisConfig(), job_pids)
    findings: list[Finding] = []
    errors: list[str] = []
    checked = 0
    for r in RULES if rules is None else rules:
        checked += 1
        try:
            findings.extend(replace(f, rule=r.id, area=r.area) for f in r.check(w))
        except Exception as exc:
            errors.append(f"rule {r.id} could not run: {type(exc).__name__}: {exc}")
    return DoctorReport(findings=findings, rules_checked=checked, rule_errors=errors)


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


# ------------------------------------------------------------------------------------------ helpers


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _subject(indices: Iterable[int]) -> str:
    """'GPU 3' or 'GPUs 0-3,5', as the doctor's gpu_subject writes them: one finding covers every GPU."""
    ordered = sorted(indices)
    return f"GPU {ordered[0]}" if len(ordered) == 1 else f"GPUs {fmt_index_list(ordered)}"


def _ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {fmt_index_list(ordered)}"


def _figures(indices: Sequence[int], worst: int, detail: str, *, lead: str | None = "for", noun: str = "GPU") -> str:
    """The figures at the end of a title: ' for 72% of 60 s' (or ' (72% of 60 s)' without a lead word) for
    one GPU or rank; ' (worst GPU 3: 72% of 60 s)' when the finding covers several."""
    if len(indices) > 1:
        return f" (worst {noun} {worst}: {detail})"
    if lead is None:
        return f" ({detail})"
    return f" {lead} {detail}" if lead else f" {detail}"


def _sentence(text: str) -> str:
    """Upper-case the first letter only ('driver thermal slowdown (GPU ...)' keeps its 'GPU')."""
    return text[:1].upper() + text[1:]


def _mhz(hertz: float | None) -> str:
    return "?" if hertz is None else f"{hertz / 1e6:.0f}"


def _mhz_value(hertz: float | None) -> int | None:
    """Hertz as whole MHz, for evidence."""
    return None if hertz is None else round(hertz / 1e6)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _growth(values: Iterable[int | None]) -> int:
    """How much a counter grew: the sum of its rises between readings. A fall is a driver or host restart
    that reset it, not negative growth, and a missing reading bridges to the next one."""
    known = [v for v in values if v is not None]
    return sum(max(0, b - a) for a, b in pairwise(known))


@dataclass(frozen=True)
class _Share:
    """How often a condition held on one GPU, over the samples where it could be judged."""

    index: int
    judged: list[GpuSample]
    hits: list[GpuSample]
    seconds: float  # time the judged samples cover

    @property
    def fraction(self) -> float:
        return len(self.hits) / len(self.judged)


def _share_under_load(
    w: Window, index: int, known: Callable[[GpuSample], bool], hit: Callable[[GpuSample], bool]
) -> _Share | None:
    """The condition over this GPU's loaded samples that carry the fields it needs; None when too few."""
    judged = [g for g in w.loaded(index) if known(g)]
    if not w.sustained(len(judged)):
        return None
    return _Share(index, judged, [g for g in judged if hit(g)], w.seconds(len(judged)))


def _reasons(g: GpuSample) -> set[str]:
    return set(g.clock_event_reasons or [])


def _has_reasons(g: GpuSample) -> bool:
    return g.clock_event_reasons is not None


def _clock_detail(hits: list[GpuSample]) -> tuple[float | None, float | None]:
    """Median SM clock while the condition held, and the GPU's maximum SM clock."""
    return _median(g.sm_clock_hertz for g in hits), _median(g.sm_clock_max_hertz for g in hits)


def _clock_cost(clock: float | None, clock_max: float | None) -> str:
    if clock is None or not clock_max:
        return "the SM clock drops"
    return f"SM clock {_mhz(clock_max)} → {_mhz(clock)} MHz, ~{1 - clock / clock_max:.0%} slower compute"


# ----------------------------------------------------------------------------------- GPU health


@rule("monitor.gpu_lost", Area.HARDWARE, "A GPU fell off the bus during the window (NVML: GPU is lost)")
def gpu_lost(w: Window) -> Iterator[Finding]:
    start = w.samples[0].time if w.samples else 0.0
    lost: dict[int, list[float]] = {}
    for s in w.samples:
        for g in s.gpus:
            if g.lost:
                lost.setdefault(g.index, []).append(s.time)
    if not lost:
        return
    first = min(lost, key=lambda i: lost[i][0])
    after = f"{lost[first][0] - start:.0f} s into the window"
    yield Finding(
        Severity.FAIL,
        f"{_subject(lost)} fell off the bus (NVML: GPU is lost), "
        + (after if len(lost) == 1 else f"first GPU {first}, {after}"),
        subject=_subject(lost),
        cost="Any process on the GPU crashes or hangs; a NCCL job across all GPUs hangs or fails with it.",
        fix="Drain the node and reset or reboot it; if it repeats, ask the provider to replace the GPU or check "
        "the riser, power and cooling.",
        evidence={
            i: {
                "first_lost_s": round(times[0] - start, 1),
                "lost_samples": len(times),
                "answering_again": _answers_after(w, i, times[-1]),
                "uuid": next((g.uuid for g in w.gpus.get(i, []) if g.uuid), None),
            }
            for i, times in sorted(lost.items())
        },
        command="nvidia-smi -L; dmesg | grep -i xid",
    )


def _answers_after(w: Window, index: int, time: float) -> bool:
    """Whether the GPU answered again after it was last seen lost (a reset within the window)."""
    return any(g.index == index and not g.lost for s in w.samples if s.time > time for g in s.gpus)


@rule("monitor.ecc_xid_errors", Area.HARDWARE, "ECC error or Xid counters grew during the window")
def ecc_xid_errors(w: Window) -> Iterator[Finding]:
    cfg = w.config
    uncorrected = {i: n for i, s in w.gpus.items() if (n := _growth(g.ecc_uncorrected_total for g in s)) > 0}
    xids = {i: n for i, s in w.gpus.items() if (n := _growth(g.xid_total for g in s)) > 0}
    corrected = {
        i: n for i, s in w.gpus.items() if (n := _growth(g.ecc_corrected_total for g in s)) >= cfg.ecc_corrected_info
    }
    span = fmt_duration(w.seconds(len(w.samples)))
    if uncorrected:
        yield Finding(
            Severity.FAIL,
            f"{sum(uncorrected.values())} uncorrectable ECC error(s) in the last {span}",
            subject=_subject(uncorrected),
            cost="The process that touched the bad memory is killed; results computed before may be corrupt.",
            fix="Drain the GPU and reset it (the driver remaps the row on reset); resume from the last checkpoint "
            "before the error; ask the provider to replace the GPU if errors return.",
            evidence={"uncorrected_growth": uncorrected},
            command="nvidia-smi -q -d ECC,ROW_REMAPPER",
        )
    if xids:
        yield Finding(
            Severity.WARN,
            f"{sum(xids.values())} new Xid event(s) in the kernel log in the last {span}",
            subject=_subject(xids),
            cost="An Xid is the driver reporting a GPU fault: from a crashed program (Xid 13, 31, 43) to failing "
            "memory, NVLink or PCIe (48, 74, 79, 92-95); the job may have crashed or slowed.",
            fix="Read the codes (dmesg | grep Xid) and run `redline doctor`, which sorts them into application "
            "faults and hardware faults.",
            evidence={"xid_growth": xids},
            command="dmesg -T | grep -i 'NVRM: Xid'",
        )
    if corrected:
        yield Finding(
            Severity.INFO,
            f"{sum(corrected.values())} corrected ECC errors in the last {span}",
            subject=_subject(corrected),
            cost="Handled by the GPU and harmless by themselves; a steady stream points at a weak memory row "
            "that may turn into uncorrectable errors.",
            fix="Watch the counter; a reset lets the GPU remap the row (nvidia-smi -q -d ROW_REMAPPER shows pending "
            "remaps).",
            evidence={"corrected_growth": corrected},
            command="nvidia-smi -q -d ECC",
        )


# ---------------------------------------------------------------------------------- clocks and power


def _throttle_evidence(share: _Share, among: Callable[[str], bool]) -> dict[str, Any]:
    """What a throttling finding shows per GPU: how often, which reasons, clocks, power and temperature."""
    return {
        "fraction": round(share.fraction, 3),
        "under_load_s": round(share.seconds, 1),
        "reasons": dict(Counter(r for g in share.hits for r in _reasons(g) if among(r))),
        "sm_clock_mhz": _mhz_value(_median(g.sm_clock_hertz for g in share.hits)),
        "sm_clock_max_mhz": _mhz_value(_median(g.sm_clock_max_hertz for g in share.judged)),
        "temperature_celsius": _median(g.temperature_celsius for g in share.hits),
        "slowdown_celsius": _median(g.temperature_slowdown_celsius for g in share.judged),
        "power_watts": _median(g.power_watts for g in share.hits),
        "power_limit_watts": _median(g.power_limit_watts for g in share.judged),
    }


def _top_reason(share: _Share, among: Callable[[str], bool]) -> str:
    return Counter(r for g in share.hits for r in _reasons(g) if among(r)).most_common(1)[0][0]


@rule("monitor.thermal", Area.POWER_THERMAL, "Clocks held down by thermal or hardware slowdown under load")
def thermal(w: Window) -> Iterator[Finding]:
    shares = [
        share
        for i in w.gpus
        if (share := _share_under_load(w, i, _has_reasons, lambda g: bool(_reasons(g) & HARDWARE_REASONS)))
        and share.fraction >= w.config.hardware_throttle_fraction
    ]
    if not shares:
        return
    indices = [s.index for s in shares]
    worst = max(shares, key=lambda s: (s.fraction, _median(g.temperature_celsius for g in s.hits) or 0.0))
    reason = _top_reason(worst, HARDWARE_REASONS.__contains__)
    temperature = _median(g.temperature_celsius for g in worst.hits)
    at = "" if temperature is None else f" at {temperature:.0f} °C"
    clock, clock_max = _clock_detail(worst.hits)
    yield Finding(
        Severity.FAIL,
        f"{_subject(indices)} throttled by {reason}"
        + _figures(indices, worst.index, f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load{at}"),
        subject=_subject(indices),
        cost=f"{_sentence(HARDWARE_THROTTLE[reason])}: {_clock_cost(clock, clock_max)} on GPU {worst.index} "
        "while it lasts, and in a synchronous job every GPU waits for the slowest.",
        fix="Check cooling (fans, airflow, inlet temperature, a blocked heatsink) and power delivery (PSU, cables, "
        "a chassis power brake); ask the provider, with these figures.",
        evidence={s.index: _throttle_evidence(s, HARDWARE_REASONS.__contains__) for s in shares},
        command=f"nvidia-smi -i {worst.index} -q -d PERFORMANCE,TEMPERATURE",
    )


def _other_reason(reason: str) -> bool:
    return reason not in NOT_THROTTLING and reason != POWER_CAP and reason not in HARDWARE_REASONS


@rule("monitor.throttling", Area.POWER_THERMAL, "Clocks limited under load by reasons other than power or heat")
def throttling(w: Window) -> Iterator[Finding]:
    shares = [
        share
        for i in w.gpus
        if (share := _share_under_load(w, i, _has_reasons, lambda g: any(map(_other_reason, _reasons(g)))))
        and share.fraction >= w.config.hardware_throttle_fraction
    ]
    if not shares:
        return
    indices = [s.index for s in shares]
    worst = max(shares, key=lambda s: s.fraction)
    reason = _top_reason(worst, _other_reason)
    clock, clock_max = _clock_detail(worst.hits)
    yield Finding(
        Severity.WARN,
        f"{_subject(indices)} clocks limited by {reason}"
        + _figures(indices, worst.index, f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load"),
        subject=_subject(indices),
        cost=f"{_sentence(OTHER_REASON_TEXT.get(reason, 'a clock limit'))} holds the GPU below its rated "
        f"clocks: {_clock_cost(clock, clock_max)} on GPU {worst.index} while it lasts.",
        fix="Ask the provider why the board limits its clocks (nvidia-smi -q -d PERFORMANCE names the reason); "
        "a newer driver may report it more precisely.",
        evidence={s.index: _throttle_evidence(s, _other_reason) for s in shares},
        command=f"nvidia-smi -i {worst.index} -q -d PERFORMANCE",
    )


@rule("monitor.power_limit", Area.POWER_THERMAL, "GPU held at its power cap under load, with the cost in clocks")
def power_limit(w: Window) -> Iterator[Finding]:
    cfg = w.config
    shares = [
        share
        for i in w.gpus
        if (share := _share_under_load(w, i, _has_reasons, lambda g: POWER_CAP in _reasons(g)))
        and share.fraction >= cfg.power_cap_fraction
    ]
    if not shares:
        return
    limits = {i: _median(g.power_limit_watts for g in series) for i, series in w.gpus.items()}
    names = {i: next((g.name for g in series if g.name), None) for i, series in w.gpus.items()}

    def peer_limit(index: int) -> float | None:
        """The highest limit among GPUs of the same model: what this one could be allowed."""
        same = [v for i, v in limits.items() if v is not None and names[i] == names[index]]
        return max(same) if same else None

    def clock_ratio(share: _Share) -> float | None:
        clock, clock_max = _clock_detail(share.hits)
        return clock / clock_max if clock is not None and clock_max else None

    lowered = [
        s.index
        for s in shares
        if (mine := limits[s.index]) is not None
        and (peer := peer_limit(s.index))
        and mine < peer * cfg.power_limit_peer_tolerance
    ]
    slow = [s.index for s in shares if (r := clock_ratio(s)) is not None and r < cfg.power_cap_clock_ratio]
    indices = [s.index for s in shares]
    # the GPU to name: the one with the lowest lowered limit, else the one that loses most clock
    low = min(lowered, key=lambda i: limits[i] or 0.0) if lowered else None
    worst = (
        next(s for s in shares if s.index == low)
        if low is not None
        else min(shares, key=lambda s: clock_ratio(s) or 1.0)
    )
    draw = _median(g.power_watts for g in worst.hits)
    limit = limits[worst.index]
    clock, clock_max = _clock_detail(worst.hits)
    figures = (
        f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load, "
        + (f"drawing {draw:.0f} of {limit:.0f} W, " if draw is not None and limit is not None else "")
        + f"SM {_mhz(clock)} of {_mhz(clock_max)} MHz"
    )
    if low is not None:
        cost = (
            f"GPU {low}'s limit of {limits[low]:.0f} W is below the {peer_limit(low):.0f} W of its peers: it runs "
            "slower than they do, and a synchronous job runs at its pace."
        )
    elif slow:
        cost = f"At the cap the GPU gives up clock speed: {_clock_cost(clock, clock_max)} on GPU {worst.index}."
    else:
        cost = (
            "Normal on dense matmuls at full board power: the GPU trades a little clock for power "
            f"({_clock_cost(clock, clock_max)})."
        )
    yield Finding(
        Severity.WARN if lowered or slow else Severity.INFO,
        f"{_subject(indices)} held at the power cap" + _figures(indices, worst.index, figures),
        subject=_subject(indices),
        cost=cost,
        fix="Compare Enforced with Default Power Limit (nvidia-smi -q -d POWER) and ask the provider to restore a "
        "lowered limit (nvidia-smi -pl needs root on the host); at the default limit, a cooler GPU holds higher "
        "clocks at the same power.",
        evidence={s.index: _throttle_evidence(s, POWER_CAP.__eq__) for s in shares}
        | {"lowered_limit": lowered, "clock_below_ratio": slow},
        command=f"nvidia-smi -i {worst.index} -q -d POWER,PERFORMANCE",
    )


# ---------------------------------------------------------------------------------------- GPU memory


def _used_ratio(g: GpuSample) -> float | None:
    if g.memory_used_bytes is None or not g.memory_total_bytes:
        return None
    return g.memory_used_bytes / g.memory_total_bytes


@rule("monitor.memory_near_full", Area.GPU_MEMORY, "GPU memory nearly full for most of the window")
def memory_near_full(w: Window) -> Iterator[Finding]:
    cfg = w.config
    full: dict[int, tuple[float, list[GpuSample], float]] = {}  # index -> (fraction, full samples, seconds)
    for index, series in w.gpus.items():
        judged = [g for g in series if _used_ratio(g) is not None]
        if not w.sustained(len(judged)):
            continue
        hits = [g for g in judged if (_used_ratio(g) or 0.0) >= cfg.memory_full_ratio]
        if len(hits) / len(judged) >= cfg.sustained_fraction:
            full[index] = (len(hits) / len(judged), hits, w.seconds(len(judged)))
    if not full:
        return
    indices = sorted(full)
    worst = max(indices, key=lambda i: max(_used_ratio(g) or 0.0 for g in full[i][1]))
    fraction, hits, seconds = full[worst]
    peak = max(hits, key=lambda g: _used_ratio(g) or 0.0)
    yield Finding(
        Severity.WARN,
        f"{_subject(indices)} memory"
        + ("" if len(indices) == 1 else " nearly full")
        + _figures(
            indices,
            worst,
            f"{_used_ratio(peak):.0%} full for {fraction:.0%} of {fmt_duration(seconds)}, up to "
            f"{fmt_bytes(peak.memory_used_bytes)} of {fmt_bytes(peak.memory_total_bytes)}",
            lead="",
        ),
        subject=_subject(indices),
        cost="No headroom: a longer sequence, a larger evaluation batch or fragmentation ends in CUDA out-of-memory, "
        "and near the limit PyTorch's caching allocator frees its cache and retries (synchronising the GPU), "
        "which slows steps before anything fails.",
        fix="Leave ~10% free: a smaller micro-batch with more accumulation, activation checkpointing, or sharded "
        "optimizer state (ZeRO/FSDP); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation. "
        "JAX preallocates on purpose (XLA_PYTHON_CLIENT_MEM_FRACTION). If another process holds the memory, "
        "see monitor.foreign_process.",
        evidence={
            i: {
                "full_fraction": round(f, 3),
                "used_ratio_max": round(max(_used_ratio(g) or 0.0 for g in h), 4),
                "used_bytes_max": max(g.memory_used_bytes or 0 for g in h),
                "total_bytes": h[0].memory_total_bytes,
            }
            for i, (f, h, _) in sorted(full.items())
        },
        command="nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv -l 1",
    )


@dataclass(frozen=True)
class _Holder:
    """A process that held GPU memory for most of the window."""

    gpu: int
    pid: int
    name: str | None
    user: str | None
    held_bytes: int

    def label(self) -> str:
        return f"{self.name or '?'}[{self.pid}]"

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "pid": self.pid, "name": self.name, "user": self.user, "bytes": self.held_bytes}


def _holders(w: Window, index: int) -> list[_Holder]:
    """Processes present in a sustained share of this GPU's samples, holding ``holder_bytes`` or more (median
    over the samples that list them). A process whose memory NVML cannot report is left out: no evidence."""
    series = w.gpus.get(index, [])
    if not w.sustained(len(series)):
        return []
    sizes: dict[int, list[int]] = {}
    present: Counter[int] = Counter()
    names: dict[int, str | None] = {}
    users: dict[int, str | None] = {}
    for g in series:
        for p in g.processes:
            present[p.pid] += 1
            names[p.pid] = p.name or names.get(p.pid)  # /proc may stop answering for a pid: keep what it said
            users[p.pid] = p.user or users.get(p.pid)
            if p.used_memory_bytes is not None:
                sizes.setdefault(p.pid, []).append(p.used_memory_bytes)
    out = []
    for pid, held in sizes.items():
        median = int(statistics.median(held))
        if present[pid] >= w.config.sustained_fraction * len(series) and median >= w.config.holder_bytes:
            out.append(_Holder(index, pid, names[pid], users[pid], median))
    return sorted(out, key=lambda h: -h.held_bytes)


def _holders_title(holders: list[_Holder], where: str) -> str:
    total = sum(h.held_bytes for h in holders)
    names = ", ".join(h.label() for h in holders[:4]) + (", ..." if len(holders) > 4 else "")
    return f"{len(holders)} process(es) {where}, holding {fmt_bytes(total)}: {names}"


def _apps_command(indices: Iterable[int]) -> str:
    gpus = ",".join(map(str, sorted(indices)))
    return f"nvidia-smi -i {gpus} --query-compute-apps=pid,process_name,used_memory --format=csv"


@rule("monitor.foreign_process", Area.GPU_MEMORY, "Processes outside the job hold GPU memory")
def foreign_process(w: Window) -> Iterator[Finding]:
    """Only when ``job_pids`` is given and at least one of them shows up on a GPU: otherwise every process,
    the job's own included, would look foreign."""
    job = w.pid_gpus
    if not w.job_pids or not job:
        return
    foreign = [h for i in w.gpus for h in _holders(w, i) if h.pid not in w.job_pids]
    shared = [h for h in foreign if h.gpu in job]
    apart = [h for h in foreign if h.gpu not in job]
    if shared:
        gpus = {h.gpu for h in shared}
        yield Finding(
            Severity.WARN,
            _holders_title(shared, f"outside the job on its {_subject(gpus)}"),
            subject=_subject(gpus),
            cost="They share the job's GPUs: less memory for the job (out-of-memory at a smaller batch) and, "
            "whenever they run kernels, fewer SM cycles for it: slower steps.",
            fix="Find out whose they are (ps -o pid,user,etime,cmd -p PID) and stop them, or move the job to free "
            "GPUs with CUDA_VISIBLE_DEVICES.",
            evidence={"processes": [h.to_dict() for h in shared], "job_gpus": sorted(job)},
            command=_apps_command(gpus),
        )
    if apart:
        gpus = {h.gpu for h in apart}
        yield Finding(
            Severity.INFO,
            _holders_title(apart, f"outside the job on {_subject(gpus)}"),
            subject=_subject(gpus),
            cost="They hold GPUs the job does not use: fine if they are another job of yours, memory held for "
            "nothing if they are leftovers of a finished or crashed run.",
            fix="Stop the leftovers (kill PID) so the GPUs are free for the next job.",
            evidence={"processes": [h.to_dict() for h in apart], "job_gpus": sorted(job)},
            command=_apps_command(gpus),
        )


def _idle(w: Window, index: int) -> bool:
    """Idle over the whole window: every utilisation reading at about zero, and enough readings to say so."""
    readings = [g.utilization_ratio for g in w.gpus.get(index, []) if g.utilization_ratio is not None]
    return w.sustained(len(readings)) and max(readings) <= w.config.idle_utilization


@rule("monitor.idle_memory_holder", Area.GPU_MEMORY, "GPU memory held on a GPU that stays idle")
def idle_memory_holder(w: Window) -> Iterator[Finding]:
    idle = [i for i in w.gpus if _idle(w, i)]
    # where the job's processes are known, the others are monitor.foreign_process's, wherever they sit
    holders = [h for i in idle for h in _holders(w, i) if not w.pid_gpus or h.pid in (w.job_pids or set())]
    span = fmt_duration(w.seconds(len(w.samples)))
    if holders:
        gpus = {h.gpu for h in holders}
        yield Finding(
            Severity.WARN,
            _holders_title(holders, f"on idle {_subject(gpus)} (no kernel for {span})"),
            subject=_subject(gpus),
            cost="Memory held by processes that run nothing: no other job can use these GPUs. Typically a "
            "leftover of a crashed or finished run, a hung rank, or a notebook kernel that still holds a model.",
            fix="Stop the leftovers (kill PID); in a notebook, del the model and call torch.cuda.empty_cache(), "
            "or restart the kernel. A hung rank of a running job: take its stack with py-spy dump --pid PID.",
            evidence={"processes": [h.to_dict() for h in holders], "idle_utilization_max": w.config.idle_utilization},
            command=_apps_command(gpus),
        )
    # memory in use and no process listed at all: processes of another PID namespace (container, VM)
    hidden = {
        i: used
        for i in idle
        if not any(g.processes for g in w.gpus[i])
        and (used := _median(g.memory_used_bytes for g in w.gpus[i])) is not None
        and used >= w.config.holder_bytes
    }
    if hidden:
        yield Finding(
            Severity.WARN,
            f"{fmt_bytes(sum(hidden.values()))} of memory in use on idle {_subject(hidden)} with no visible process",
            subject=_subject(hidden),
            cost="Someone holds these GPUs without using them: another container or VM tenant, whose processes "
            "NVML does not show inside this PID namespace.",
            fix="Ask who else runs on this server; on the host, nvidia-smi lists every process.",
            evidence={"memory_used_bytes": {i: int(v) for i, v in hidden.items()}},
            command=f"nvidia-smi -i {','.join(map(str, sorted(hidden)))}",
        )


# ------------------------------------------------------------------------------------------ the job


def _few(flagged: int, total: int) -> bool:
    """Stragglers are a minority: when half the ranks or GPUs are "slow" there is no straggler, only two
    kinds of rank (two GPU models, two nodes). With two ranks the slower one, which the other waits for, is."""
    return flagged * 2 < total or (total == 2 and flagged == 1)


def _waiting_s(step: StepSample) -> float:
    """Time a step spent outside its own work: the exposed communication the runtime reported, or what the
    phases leave of the step. In a synchronous job this is where a fast rank waits for a slow one."""
    remainder = step.time_s - step.data_s - step.compute_s - step.optimizer_s
    return max(0.0, remainder, step.comm_s or 0.0)


# the phases of a step that are a rank's own work, as StepSample names them: (short name, in a sentence)
PHASES = {
    "data_s": ("data", "loading data"),
    "compute_s": ("compute", "in compute"),
    "optimizer_s": ("optimizer", "in the optimizer step"),
}


def _own_s(step: StepSample) -> float:
    """A rank's own work in a step: everything but waiting for the other ranks."""
    return step.data_s + step.compute_s + step.optimizer_s


@dataclass(frozen=True)
class _RankLag:
    rank: int
    own_s: float  # median of this rank's own work per step
    others_own_s: float  # median, over the same steps, of the other ranks' median own work
    phase: str  # the StepSample field where most of the excess is: data_s, compute_s or optimizer_s
    phase_s: float
    others_phase_s: float
    slow_fraction: float
    steps: int
    others_wait_s: float

    @property
    def longer(self) -> float:
        return self.own_s / self.others_own_s - 1 if self.others_own_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "own_work_median_s": round(self.own_s, 4),
            "others_own_work_median_s": round(self.others_own_s, 4),
            "phase": self.phase,
            "phase_median_s": round(self.phase_s, 4),
            "others_phase_median_s": round(self.others_phase_s, 4),
            "slow_step_fraction": round(self.slow_fraction, 3),
            "steps_compared": self.steps,
            "others_wait_median_s": round(self.others_wait_s, 4),
        }


def _rank_lag(w: Window, rank: int, pairs: list[tuple[StepSample, list[StepSample]]]) -> _RankLag | None:
    """This rank against the others, step by step: slower at its own work in a sustained share of the steps,
    and the others spend at least ``straggler_wait_share`` of the difference waiting (a synchronous job)."""
    cfg = w.config
    mine = [_own_s(st) for st, _ in pairs]
    refs = [statistics.median(_own_s(o) for o in others) for _, others in pairs]
    slow = sum(1 for m, ref in zip(mine, refs, strict=True) if ref > 0 and m >= ref * cfg.straggler_step_ratio)
    excess = statistics.median(m - ref for m, ref in zip(mine, refs, strict=True))
    wait = statistics.median(statistics.median(_waiting_s(o) for o in others) for _, others in pairs)
    if slow / len(pairs) < cfg.sustained_fraction or excess <= 0 or wait < cfg.straggler_wait_share * excess:
        return None

    def phase_excess(name: str) -> float:
        return statistics.median(
            getattr(st, name) - statistics.median(getattr(o, name) for o in others) for st, others in pairs
        )

    phase = max(PHASES, key=phase_excess)
    return _RankLag(
        rank,
        statistics.median(mine),
        statistics.median(refs),
        phase,
        statistics.median(getattr(st, phase) for st, _ in pairs),
        statistics.median(statistics.median(getattr(o, phase) for o in others) for _, others in pairs),
        slow / len(pairs),
        len(pairs),
        wait,
    )


def _step_stragglers(w: Window) -> list[_RankLag] | None:
    """Ranks slower than the others at their own work on the same steps while the others wait for them; None
    when the window holds too few steps from too few ranks to judge (then the GPUs are judged instead).

    Own work, not compute alone: a rank whose DataLoader is slow holds the job back as surely as a rank whose
    GPU is throttled, and the phase that differs says which it is."""
    by_rank: dict[int, dict[int, StepSample]] = {}
    for st in w.steps:
        by_rank.setdefault(st.rank, {})[st.step] = st
    ranks = {r: steps for r, steps in by_rank.items() if len(steps) >= w.config.min_steps}
    lags: list[_RankLag] = []
    judged = 0
    for rank, steps in sorted(ranks.items()):
        pairs = [
            (st, others)
            for number, st in steps.items()
            if (others := [ranks[o][number] for o in ranks if o != rank and number in ranks[o]])
        ]
        if len(pairs) < w.config.min_steps:
            continue
        judged += 1
        if lag := _rank_lag(w, rank, pairs):
            lags.append(lag)
    if judged < 2:
        return None
    return lags if _few(len(lags), judged) else []


@dataclass(frozen=True)
class _GpuLag:
    index: int
    kind: str  # "utilization" or "clock"
    fraction: float
    seconds: float
    value: float  # this GPU's median over the compared samples
    others: float  # the others' median over the same samples
    reasons: dict[str, int]  # clock-event reasons seen on it, for the cause

    def describe(self) -> str:
        if self.kind == "clock":
            return f"SM clock {_mhz(self.value)} vs {_mhz(self.others)} MHz"
        return f"busy {self.value:.0%} vs {self.others:.0%}"

    def to_dict(self) -> dict[str, Any]:
        value, others = (
            (_mhz_value(self.value), _mhz_value(self.others)) if self.kind == "clock" else (self.value, self.others)
        )
        return {
            "lags_in": self.kind,
            "fraction": round(self.fraction, 3),
            "value": _round(value),
            "others_median": _round(others),
            "unit": "MHz" if self.kind == "clock" else "ratio",
            "reasons": self.reasons,
        }


_LAG_METRICS: tuple[tuple[str, Callable[[GpuSample], float | None]], ...] = (
    # utilisation first: a starved rank also drops clocks in its idle moments, but idling is its symptom
    ("utilization", lambda g: g.utilization_ratio),
    ("clock", lambda g: g.sm_clock_hertz),
)


def _lags(w: Window, kind: str, value: float, ref: float) -> bool:
    if kind == "clock":
        return value <= ref * w.config.straggler_clock_ratio
    return value <= ref - w.config.straggler_utilization_gap


def _gpu_stragglers(w: Window) -> list[_GpuLag]:
    """GPUs of the job whose utilisation or SM clock stays well below the median of the others', compared
    sample by sample while the job runs (its GPUs' median utilisation under load)."""
    cfg = w.config
    job = w.job_gpus(cfg.busy_utilization)
    if len(job) < cfg.min_job_gpus:
        return []
    active = [
        row
        for row in w.rows
        if (m := _median(row[i].utilization_ratio for i in job if i in row)) is not None and m >= cfg.busy_utilization
    ]
    lags: list[_GpuLag] = []
    for index in job:
        for kind, read in _LAG_METRICS:
            pairs: list[tuple[float, float, GpuSample]] = []
            for row in active:
                mine = read(row[index]) if index in row else None
                others = [v for j in job if j != index and j in row and (v := read(row[j])) is not None]
                if mine is not None and len(others) >= 2:
                    pairs.append((mine, statistics.median(others), row[index]))
            if not w.sustained(len(pairs)):
                continue
            hits = [p for p in pairs if _lags(w, kind, p[0], p[1])]
            if len(hits) / len(pairs) >= cfg.sustained_fraction:
                reasons = Counter(r for _, _, g in hits for r in _reasons(g) if r not in NOT_THROTTLING)
                lags.append(
                    _GpuLag(
                        index,
                        kind,
                        len(hits) / len(pairs),
                        w.seconds(len(pairs)),
                        statistics.median(p[0] for p in hits),
                        statistics.median(p[1] for p in hits),
                        dict(reasons),
                    )
                )
                break
    return lags if _few(len(lags), len(job)) else []


@rule("monitor.straggler", Area.DISTRIBUTED, "One rank or GPU of the job consistently slower than the others")
def straggler(w: Window) -> Iterator[Finding]:
    """Step times from several ranks are the stronger evidence (they measure the work itself), so when the
    window holds them the GPUs' utilisation and clocks are not judged at all."""
    ranks = _step_stragglers(w)
    if ranks is not None:
        if ranks:
            yield _rank_straggler(w, ranks)
        return
    gpus = _gpu_stragglers(w)
    if gpus:
        yield _gpu_straggler(w, gpus)


RANK_FIXES = {
    "data_s": "That rank's input is slower: look at its DataLoader workers, the CPU cores and NUMA node it runs on "
    "(numactl, taskset), and its shard of the data (larger samples, files on slower storage).",
    "compute_s": "Look at that rank's GPU: clocks, temperature and throttle reasons (monitor.thermal, "
    "monitor.power_limit), its PCIe link, other processes on it. Uneven work per rank (variable sequence lengths) "
    "looks the same: balance the batches by tokens.",
    "optimizer_s": "Its optimizer step is slower: an uneven parameter partition (ZeRO/FSDP shards) or a slower "
    "GPU; check its GPU's clocks and the sharding.",
}


def _rank_straggler(w: Window, lags: list[_RankLag]) -> Finding:
    worst = max(lags, key=lambda r: r.longer)
    ranks = [r.rank for r in lags]
    step = statistics.median(st.time_s for st in w.steps)
    detail = (
        f"{PHASES[worst.phase][0]} {worst.phase_s * 1e3:.0f} vs {worst.others_phase_s * 1e3:.0f} ms per "
        f"step, in {worst.slow_fraction:.0%} of {worst.steps} steps"
    )
    return Finding(
        Severity.WARN,
        f"{_sentence(_ranks(ranks))} {'takes' if len(ranks) == 1 else 'take up to'} {worst.longer:.0%} longer than "
        f"the other ranks, mostly {PHASES[worst.phase][1]}"
        + _figures(ranks, worst.rank, detail, lead=None, noun="rank"),
        subject=_ranks(ranks),
        cost=f"The other ranks wait ~{worst.others_wait_s * 1e3:.0f} ms per step for it "
        f"({worst.others_wait_s / step:.0%} of a {step * 1e3:.0f} ms step): the whole job runs at the pace of "
        f"rank {worst.rank}."
        if step > 0
        else f"The whole job runs at the pace of rank {worst.rank}.",
        fix=RANK_FIXES[worst.phase],
        evidence={r.rank: r.to_dict() for r in lags} | {"step_time_median_s": round(step, 4)},
        command=None,
    )


def _gpu_straggler(w: Window, lags: list[_GpuLag]) -> Finding:
    worst = max(lags, key=lambda g: g.fraction)
    indices = [g.index for g in lags]
    others = len(w.job_gpus(w.config.busy_utilization)) - len(indices)
    detail = f"{worst.describe()} in {worst.fraction:.0%} of {fmt_duration(worst.seconds)}"
    if worst.kind == "clock":
        cause = (
            f"(reasons seen: {', '.join(sorted(worst.reasons))})" if worst.reasons else "(no clock-event reason set)"
        )
        cost = (
            f"GPU {worst.index} computes at a lower clock {cause}; in a synchronous job the other GPUs wait for "
            "its rank every step, so the job runs at its pace."
        )
        fix = (
            "See why its clocks are low: temperature, power and throttle reasons (monitor.thermal, "
            "monitor.power_limit); cooling or a lowered power limit are the usual causes; ask the provider."
        )
    else:
        cost = (
            f"GPU {worst.index} is left without work part of every step: its rank is slower to feed it, and in a "
            "synchronous job the other GPUs wait (their NCCL kernels spin, so they still look busy)."
        )
        fix = (
            "Look at that rank's host side: its DataLoader workers, its CPU affinity and NUMA node (nvidia-smi topo "
            "-m), other processes on its GPU; uneven batches (variable lengths) look the same."
        )
    return Finding(
        Severity.WARN,
        f"{_subject(indices)} {'lags' if len(indices) == 1 else 'lag'} the other {others} GPUs of the job"
        + _figures(indices, worst.index, detail, lead=None),
        subject=_subject(indices),
        cost=cost,
        fix=fix,
        evidence={g.index: g.to_dict() for g in lags},
        command="nvidia-smi dmon -s puc -d 1",
    )


@rule("monitor.input_bound", Area.HOST, "The job's GPUs wait for input: data loading or the host sets the pace")
def input_bound(w: Window) -> Iterator[Finding]:
    """Step data, when the window holds enough of it, decides alone: a host at 100% CPU with GPUs half idle
    and no time spent waiting for batches is bound by something else (Python overhead, kernel launches)."""
    steps = [st for st in w.steps if st.time_s > 0]
    if len(steps) >= w.config.min_steps:
        yield from _input_bound_steps(w, steps)
    else:
        yield from _input_bound_host(w)


def _host_context(hosts: Iterable[HostSample]) -> dict[str, float | None]:
    listed = list(hosts)
    return {
        "host_cpu_ratio": _round(_median(h.cpu_ratio for h in listed)),
        "host_iowait_ratio": _round(_median(h.cpu_iowait_ratio for h in listed)),
        "disk_read_bytes_per_second": _median(h.disk_read_bytes_per_second for h in listed),
    }


INPUT_FIX_CPU = (
    "Feed the GPUs faster: more DataLoader workers (up to the cores per GPU), pin_memory=True, "
    "persistent_workers=True, prefetch_factor=4; move decoding and augmentation to the GPU (DALI, torchvision "
    "v2 on tensors) or do them once offline."
)
INPUT_FIX_STORAGE = (
    "Read faster: stage the data set on local NVMe instead of network storage, pack small files into shards "
    "(WebDataset, tar, Arrow) and read them sequentially, with more workers to keep more reads in flight."
)


def _input_bound_steps(w: Window, steps: list[StepSample]) -> Iterator[Finding]:
    cfg = w.config
    shares = [st.data_s / st.time_s for st in steps]
    waiting = [s for s in shares if s >= cfg.input_data_share]
    if len(waiting) / len(shares) < cfg.sustained_fraction:
        return
    share = sum(st.data_s for st in steps) / sum(st.time_s for st in steps)
    context = _host_context(w.hosts)
    storage = (context["host_iowait_ratio"] or 0.0) >= cfg.host_iowait_high
    yield Finding(
        Severity.FAIL if statistics.median(shares) >= cfg.input_data_share_fail else Severity.WARN,
        f"Steps wait for data {share:.0%} of the time ({len(waiting)} of {len(steps)} steps wait "
        f"{cfg.input_data_share:.0%} or more)",
        subject=_ranks({st.rank for st in steps}),
        cost=f"The GPUs idle while the next batch is prepared: with the input keeping up, steps would run up to "
        f"{1 / max(1 - share, 0.01):.1f}x faster.",
        fix=INPUT_FIX_STORAGE if storage else INPUT_FIX_CPU,
        evidence={
            "data_share": round(share, 3),
            "waiting_steps": len(waiting),
            "steps": len(steps),
            "data_median_s": round(statistics.median(st.data_s for st in steps), 4),
            "step_median_s": round(statistics.median(st.time_s for st in steps), 4),
        }
        | context,
        command="top -H; iostat -x 1",
    )


def _input_bound_host(w: Window) -> Iterator[Finding]:
    cfg = w.config
    job = w.job_gpus(cfg.in_use_utilization)
    if not job:
        return
    judged = 0
    hits: list[tuple[float, HostSample]] = []
    for sample, row in zip(w.samples, w.rows, strict=True):
        host = sample.host
        utilization = _mean(row[i].utilization_ratio for i in job if i in row)
        if host is None or utilization is None or (host.cpu_ratio is None and host.cpu_iowait_ratio is None):
            continue
        judged += 1
        cpu = host.cpu_ratio is not None and host.cpu_ratio >= cfg.host_cpu_saturated
        io = host.cpu_iowait_ratio is not None and host.cpu_iowait_ratio >= cfg.host_iowait_high
        if utilization <= cfg.input_gpu_utilization_max and (cpu or io):
            hits.append((utilization, host))
    if not w.sustained(judged) or len(hits) / judged < cfg.sustained_fraction:
        return
    busy = statistics.median(u for u, _ in hits)
    context = _host_context(h for _, h in hits)
    cpu_ratio, iowait = context["host_cpu_ratio"], context["host_iowait_ratio"]
    storage = iowait is not None and iowait >= cfg.host_iowait_high and not (cpu_ratio or 0) >= cfg.host_cpu_saturated
    waits_on = f"waits on storage (iowait {iowait:.0%})" if storage else f"CPU runs at {cpu_ratio or 0:.0%}"
    yield Finding(
        Severity.WARN,
        f"{_subject(job)} busy only {busy:.0%} while the host {waits_on}, for {len(hits) / judged:.0%} of "
        f"{fmt_duration(w.seconds(judged))}",
        subject=_subject(job),
        cost=(
            f"Reading the data set sets the pace, not the GPUs: they run kernels only {busy:.0%} of the time."
            if storage
            else f"The GPUs run kernels only {busy:.0%} of the time while the host's CPUs are saturated: the input "
            "pipeline (decoding, augmentation, collation) or other host work (Python overhead, kernel launches) "
            "sets the pace."
        ),
        fix=INPUT_FIX_STORAGE
        if storage
        else INPUT_FIX_CPU + " Per-step metrics (redline.prepare) tell input waits from host overhead.",
        evidence={"gpu_utilization_median": round(busy, 3), "judged_samples": judged, "bound_samples": len(hits)}
        | context,
        command="top -H; iostat -x 1; nvidia-smi dmon -s u -d 1",
    )


# ----------------------------------------------------------------------------------- PCIe and host


def _link_known(g: GpuSample) -> bool:
    return (g.pcie_link_generation is not None and bool(g.pcie_link_generation_max)) or (
        g.pcie_link_width is not None and bool(g.pcie_link_width_max)
    )


def _link_down(g: GpuSample) -> bool:
    slow = g.pcie_link_generation is not None and bool(g.pcie_link_generation_max)
    narrow = g.pcie_link_width is not None and bool(g.pcie_link_width_max)
    return (slow and (g.pcie_link_generation or 0) < (g.pcie_link_generation_max or 0)) or (
        narrow and (g.pcie_link_width or 0) < (g.pcie_link_width_max or 0)
    )


def _link_text(generation: int | None, width: int | None) -> str:
    return " ".join(part for part in (generation and f"Gen{generation}", width and f"x{width}") if part)


def _link_gbps(generation: int | None, width: int | None) -> float | None:
    lane = PCIE_LANE_GBPS.get(generation or 0)
    return lane * width if lane and width else None


@rule("monitor.pcie_downgraded", Area.HARDWARE, "PCIe link slower or narrower than it can run, under load")
def pcie_downgraded(w: Window) -> Iterator[Finding]:
    """Idle GPUs lower their link speed to save power, which is normal: only loaded samples are judged."""
    groups: dict[tuple[int | None, int | None, int | None, int | None], list[_Share]] = {}
    for index in w.gpus:
        share = _share_under_load(w, index, _link_known, _link_down)
        if share is None or share.fraction < w.config.sustained_fraction:
            continue
        state = Counter(
            (g.pcie_link_generation, g.pcie_link_generation_max, g.pcie_link_width, g.pcie_link_width_max)
            for g in share.hits
        ).most_common(1)[0][0]
        groups.setdefault(state, []).append(share)
    for (gen, gen_max, width, width_max), shares in sorted(groups.items(), key=lambda kv: kv[1][0].index):
        indices = [s.index for s in shares]
        worst = max(shares, key=lambda s: s.fraction)
        now, best = _link_gbps(gen, width), _link_gbps(gen_max, width_max)
        yield Finding(
            Severity.FAIL,
            f"{_subject(indices)} PCIe link at {_link_text(gen, width)} under load, capable of "
            f"{_link_text(gen_max, width_max)}"
            + _figures(
                indices, worst.index, f"{worst.fraction:.0%} of {fmt_duration(worst.seconds)} under load", lead=None
            ),
            subject=_subject(indices),
            cost=(
                f"Host-to-GPU copies top out at {now:.1f} of {best:.1f} GB/s per direction ({now / best:.0%}): "
                if now and best
                else "Host-to-GPU copies run at a fraction of the link's speed: "
            )
            + "data loading, offload and PCIe collectives slow down.",
            fix="Reseat the GPU or riser, check the slot wiring and the BIOS PCIe setting; ask the provider. A link "
            "that trains down under load can be a failing riser: watch the PCIe replay counter.",
            evidence={
                s.index: {
                    "fraction": round(s.fraction, 3),
                    "generation": gen,
                    "generation_max": gen_max,
                    "width": width,
                    "width_max": width_max,
                    "pcie_rx_bytes_per_second": _median(g.pcie_rx_bytes_per_second for g in s.hits),
                    "pcie_tx_bytes_per_second": _median(g.pcie_tx_bytes_per_second for g in s.hits),
                }
                for s in shares
            },
            command=f"nvidia-smi -i {','.join(map(str, indices))} --format=csv -l 1 --query-gpu="
            "index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,utilization.gpu",
        )


@rule("monitor.host_swapping", Area.HOST, "The host swaps pages to and from disk for a sustained time")
def host_swapping(w: Window) -> Iterator[Finding]:
    cfg = w.config
    rates = [
        (h.swap_in_bytes_per_second or 0.0, h.swap_out_bytes_per_second or 0.0, h)
        for h in w.hosts
        if h.swap_in_bytes_per_second is not None or h.swap_out_bytes_per_second is not None
    ]
    if not w.sustained(len(rates)):
        return
    hits = [r for r in rates if r[0] + r[1] >= cfg.swap_bytes_per_second]
    if len(hits) / len(rates) < cfg.swap_fraction:
        return
    swap_in = statistics.median(r[0] for r in hits)
    swap_out = statistics.median(r[1] for r in hits)
    memory = _median(
        h.memory_used_bytes / h.memory_total_bytes
        for _, _, h in hits
        if h.memory_used_bytes is not None and h.memory_total_bytes
    )
    yield Finding(
        Severity.WARN,
        f"Host swapping {fmt_bytes(swap_in + swap_out)}/s (in {fmt_bytes(swap_in)}/s, out {fmt_bytes(swap_out)}/s) "
        f"for {len(hits) / len(rates):.0%} of {fmt_duration(w.seconds(len(rates)))}"
        + (f", memory {memory:.0%} used" if memory is not None else ""),
        subject="host",
        cost="Pages of the training processes and DataLoader workers go to disk and back: each swap-in stalls "
        "whoever touches the page (milliseconds to seconds), so steps slow down and jitter; the OOM killer may "
        "follow.",
        fix="Use less host memory: fewer DataLoader workers or a smaller prefetch_factor, a memory-mapped data set "
        "instead of a copy in every worker, fewer pinned buffers; or a host with more RAM.",
        evidence={
            "swap_in_bytes_per_second": swap_in,
            "swap_out_bytes_per_second": swap_out,
            "swapping_fraction": round(len(hits) / len(rates), 3),
            "memory_used_ratio": _round(memory),
            "swap_used_bytes": _median(h.swap_used_bytes for _, _, h in hits),
        },
        command="vmstat 1  # si/so columns",
    )
