"""Diagnosis rules on the job as a whole: one rank or GPU that sets the pace for the others."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from redline.doctor.model import Area, Finding, Severity
from redline.monitor.diagnose import rule
from redline.monitor.rules.power_thermal import NOT_THROTTLING
from redline.monitor.sample import GpuSample, StepSample
from redline.monitor.window import (
    Window,
    gpus_subject,
    median_of,
    mhz_text,
    ranks_subject,
    reasons_of,
    rounded,
    sentence_case,
    title_figures,
    whole_mhz,
)
from redline.units import fmt_duration


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
            return f"SM clock {mhz_text(self.value)} vs {mhz_text(self.others)} MHz"
        return f"busy {self.value:.0%} vs {self.others:.0%}"

    def to_dict(self) -> dict[str, Any]:
        value, others = (
            (whole_mhz(self.value), whole_mhz(self.others)) if self.kind == "clock" else (self.value, self.others)
        )
        return {
            "lags_in": self.kind,
            "fraction": round(self.fraction, 3),
            "value": rounded(value),
            "others_median": rounded(others),
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
        if (m := median_of(row[i].utilization_ratio for i in job if i in row)) is not None and m >= cfg.busy_utilization
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
                reasons = Counter(r for _, _, g in hits for r in reasons_of(g) if r not in NOT_THROTTLING)
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
        f"{sentence_case(ranks_subject(ranks))} {'takes' if len(ranks) == 1 else 'take up to'} "
        f"{worst.longer:.0%} longer than the other ranks, mostly {PHASES[worst.phase][1]}"
        + title_figures(ranks, worst.rank, detail, lead=None, noun="rank"),
        subject=ranks_subject(ranks),
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
        f"{gpus_subject(indices)} {'lags' if len(indices) == 1 else 'lag'} the other {others} GPUs of the job"
        + title_figures(indices, worst.index, detail, lead=None),
        subject=gpus_subject(indices),
        cost=cost,
        fix=fix,
        evidence={g.index: g.to_dict() for g in lags},
        command="nvidia-smi dmon -s puc -d 1",
    )
