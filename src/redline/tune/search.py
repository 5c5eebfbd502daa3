"""The search: which candidates to run, in which order, and which one wins.

1. The baseline: the script as ``redline run`` runs it (with the base plan if one was given). It fixes the
   global batch, which every candidate keeps.
2. Where a journal of the same script on another machine found a winner, that candidate next.
3. The micro-batch: the largest that fits, by binary search over the divisors of the per-rank batch (a trial
   that runs out of memory does not fit; one whose predicted peak, from the measured peaks, is over the
   device's memory is pruned without running), then the next smaller one, in case it is faster.
4. The leader again: the spread of two runs of one candidate is the noise; a change must gain more than
   ``max(min_gain, 2 x spread)`` to be kept.
5. Coordinate descent over the other knobs in ``space.ORDER``: each value of a knob against the leader; the
   fastest beyond the noise becomes the leader.
6. The winner again (its score is the mean of its runs), and its loss against the baseline's, step by step, on
   the same data (loss parity), within a tolerance by precision; a winner that fails is excluded and the next
   fastest is checked. A script whose losses differ between two runs of the same candidate (it does not seed
   its model) cannot be checked: said.

Every trial goes through the journal: a result already there is not run again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.errors import BadInput
from redline.tune.journal import Journal
from redline.tune.space import Candidate, Machine, default_plan, micro_batches, trial_plan
from redline.tune.trial import Setup, TrialResult, run_trial

# the largest relative step-by-step loss difference a candidate may show against the baseline, by the
# precision the candidate computes in: fp32 differs only by summation order (micro-batches, kernels)
PARITY_RTOL = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2, "fp8": 5e-2}
MIN_GAIN = 0.03  # a change must be this much faster (or beyond twice the measured noise) to be kept
MEMORY_MARGIN = 0.05  # of the device's memory, kept free when a predicted peak prunes a micro-batch

Runner = Callable[[Setup, "dict[str, Any] | None", Path], TrialResult]


@dataclass
class Budget:
    """How much the tune may spend: seconds of trials and a number of trials (None: no limit)."""

    seconds: float | None = None
    trials: int | None = None
    spent_s: float = 0.0
    run: int = 0

    def allows(self) -> bool:
        return (self.seconds is None or self.spent_s < self.seconds) and (self.trials is None or self.run < self.trials)


@dataclass(frozen=True)
class Trial:
    label: str  # what the search tried it for: "baseline", "micro-batch", a knob's name, "repeat"
    candidate: Candidate | None  # None: the baseline without a plan
    result: TrialResult
    cached: bool  # found in the journal, not run


@dataclass
class Outcome:
    baseline: TrialResult
    baseline_speed: float = 0.0  # as the search ranks (``Tuner._speed``)
    trials: list[Trial] = field(default_factory=list)
    winner: Candidate | None = None
    winner_speed: float | None = None
    spread: float | None = None  # relative difference of two runs of one candidate
    parity: str = ""
    plan: dict[str, Any] | None = None  # the winner's plan file
    stopped: str = ""  # why the search ended before it was through: the budget

    @property
    def speedup(self) -> float | None:
        if self.winner_speed and self.baseline_speed:
            return self.winner_speed / self.baseline_speed
        return None


class Tuner:
    def __init__(
        self,
        setup: Setup,
        machine: Machine,
        space: dict[str, list[Any]],
        journal: Journal,
        workdir: Path,
        *,
        base_plan: dict[str, Any] | None = None,
        budget: Budget | None = None,
        device_memory: int | None = None,
        runner: Runner = run_trial,
        progress: Callable[[Trial], None] | None = None,
    ) -> None:
        self.setup = setup
        self.machine = machine
        self.space = space
        self.journal = journal
        self.workdir = workdir
        self.base_plan = base_plan
        self.budget = budget or Budget()
        self.device_memory = device_memory
        self.runner = runner
        self.progress = progress
        self.trials: list[Trial] = []
        self.asked: set[str] = set()  # the journal keys this search has asked for
        self.per_rank_batch = 0
        self.base: dict[str, Any] = {}
        self.gain = MIN_GAIN
        self.repeated: tuple[TrialResult | None, TrialResult] | None = None  # two runs of one candidate

    # ------------------------------------------------------------------------------------------- trials

    def _run(self, label: str, candidate: Candidate | None, *, repeat: int = 1) -> TrialResult | None:
        """The candidate's result: from the journal, else run (None when the budget is spent)."""
        key = "baseline" if candidate is None else candidate.key()
        key += f" #{repeat}" if repeat > 1 else ""
        if key in self.asked:  # asked again by this search (the binary search's ends): shown once
            return self.journal.get(key)
        self.asked.add(key)
        cached = self.journal.get(key)
        if cached is None:
            if not self.budget.allows():
                return None
            plan = self.base_plan if candidate is None else self.plan_for(candidate)
            pruned = None if candidate is None else self._pruned(candidate)
            started = time.monotonic()
            # a directory of this process's own: a trial left running by a killed tune cannot write into it
            workdir = self.workdir / f"trial-{len(self.journal.results)}-{os.getpid()}"
            result = pruned or self.runner(self.setup, plan, workdir)
            self.budget.spent_s += time.monotonic() - started
            self.budget.run += pruned is None
            self.journal.record(key, candidate, result)
        trial = Trial(label, candidate, cached or result, cached is not None)
        self.trials.append(trial)
        if self.progress is not None:
            self.progress(trial)
        return trial.result

    def plan_for(self, candidate: Candidate) -> dict[str, Any]:
        return trial_plan(candidate, base=self.base, per_rank_batch=self.per_rank_batch, ranks=self.machine.ranks)

    def _pruned(self, candidate: Candidate) -> TrialResult | None:
        """A result without running, for a micro-batch whose predicted peak would not fit the device's memory
        (less ``MEMORY_MARGIN``). The prediction is a line in the micro-batch: through two measured peaks of
        candidates alike but for it; else through one measured peak with the base plan's slope (its activations
        and temporaries per sample); else the base plan's own figure, scaled to the micro-batch."""
        if self.device_memory is None:
            return None
        peaks = sorted(
            {
                t.candidate.micro_batch: t.result.peak_memory_bytes
                for t in self.trials
                if t.candidate is not None
                and t.result.status == "ok"
                and t.result.peak_memory_bytes
                and t.candidate.knobs == candidate.knobs
            }.items()
        )
        planned = self._planned_line() if not candidate.knobs else None
        if len(peaks) >= 2:
            (m1, p1), (m2, p2) = peaks[0], peaks[-1]
            slope, (m, peak), basis = (p2 - p1) / (m2 - m1), (m2, p2), f"the measured micro-batches {m1} and {m2}"
        elif planned is not None:
            slope, (m, peak) = planned[0], peaks[-1] if peaks else planned[1]
            basis = f"the plan's memory, measured at micro-batch {m}" if peaks else "the plan's memory"
        else:
            return None
        predicted = peak + slope * (candidate.micro_batch - m)
        room = self.device_memory * (1 - MEMORY_MARGIN)
        if predicted <= room:
            return None
        why = f"predicted peak {predicted / 2**30:.2f} GiB (from {basis}) over {room / 2**30:.2f} GiB"
        return TrialResult("pruned", why=why)

    def _planned_line(self) -> tuple[float, tuple[int, float]] | None:
        """The base plan's memory as a line in the micro-batch: (bytes per sample, (its micro-batch, its
        allocated bytes)); None without a plan that predicted it."""
        memory = ((self.base_plan or {}).get("predicted") or {}).get("memory_bytes") or {}
        if "allocated" not in memory:
            return None
        micro_batch = int(self.base["strategy"]["micro_batch"])
        per_sample = (memory.get("activations", 0.0) + memory.get("temporary", 0.0)) / micro_batch
        return per_sample, (micro_batch, float(memory["allocated"]))

    # ------------------------------------------------------------------------------------------- search

    def tune(self) -> Outcome:
        baseline = self._run("baseline", None)
        if baseline is None or baseline.status != "ok":
            why = baseline.why if baseline is not None else "the budget allows no trial"
            raise BadInput(f"the script does not run as it is ({why}): make `redline run` run it first")
        self.per_rank_batch = self._per_rank_batch(baseline)
        self.base = self.base_plan or default_plan(self.machine, self.per_rank_batch)
        outcome = Outcome(baseline, self._speed(baseline))
        start = Candidate(int(self.base["strategy"]["micro_batch"]))
        if self.journal.get(start.key()) is None:  # the base plan (or the defaults) as they are: the baseline
            self.journal.record(start.key(), start, baseline)
        self.asked.add(start.key())
        leader, best = start, self._speed(baseline)
        elsewhere = self.journal.best_elsewhere()
        if elsewhere is not None and elsewhere.micro_batch in micro_batches(self.per_rank_batch):
            speed = self._speed(self._run("another machine's best", elsewhere))
            if speed > best:
                leader, best = elsewhere, speed
        leader, best = self._search_micro_batch(leader, best)
        first, repeat = self.journal.get(leader.key()), self._run("repeat", leader, repeat=2)
        if repeat is not None and repeat.status == "ok" and best > 0:
            outcome.spread = abs(self._speed(repeat) - best) / best
            self.gain = max(MIN_GAIN, 2 * outcome.spread)
            self.repeated = (first, repeat)
        for knob, values in self.space.items():
            for value in values:
                if value == leader.get(knob):
                    continue
                candidate = leader.with_value(knob, value)
                result = self._run(knob, candidate)
                if result is None:
                    outcome.stopped = "the budget ran out"
                    break
                if self._speed(result) > best * (1 + self.gain):
                    leader, best = candidate, self._speed(result)
        self._choose(outcome, baseline, start)
        return outcome

    def _per_rank_batch(self, baseline: TrialResult) -> int:
        if self.base_plan is not None:
            strategy = self.base_plan["strategy"]
            return int(strategy["micro_batch"]) * int(strategy.get("accumulation", 1))
        assert baseline.samples_per_step is not None
        return baseline.samples_per_step // self.machine.ranks

    def _search_micro_batch(self, leader: Candidate, best: float) -> tuple[Candidate, float]:
        """The largest micro-batch that fits (binary search over the per-rank batch's divisors, largest first:
        a micro-batch that fits means every smaller one does), then the next smaller one."""
        sizes = micro_batches(self.per_rank_batch)
        speeds: dict[int, float] = {}

        def fits(size: int) -> bool:
            result = self._run("micro-batch", leader.with_micro_batch(size))
            speeds[size] = self._speed(result)
            return result is not None and result.status == "ok"

        low, high = 0, len(sizes) - 1
        while low < high:
            middle = (low + high) // 2
            if fits(sizes[middle]):
                high = middle
            else:
                low = middle + 1
        if sizes[low] not in speeds:
            fits(sizes[low])
        if low + 1 < len(sizes):
            fits(sizes[low + 1])
        for size, speed in speeds.items():
            if speed > best:
                leader, best = leader.with_micro_batch(size), speed
        return leader, best

    def _choose(self, outcome: Outcome, baseline: TrialResult, start: Candidate) -> None:
        """The fastest candidate that trains as the baseline does, confirmed by a second run."""
        ranked = sorted(
            {t.candidate.key(): t for t in self.trials if t.candidate is not None and t.result.status == "ok"}.values(),
            key=lambda t: -self._speed(t.result),
        )
        for trial in ranked[:3]:
            candidate = trial.candidate
            assert candidate is not None
            verdict = self._parity(candidate, trial.result, baseline)
            if verdict is not None and verdict.startswith("FAILED"):
                self.trials.append(Trial("parity", candidate, TrialResult("parity", why=verdict[8:]), False))
                continue
            again = self._run("confirm", candidate, repeat=2) if candidate != start else None
            runs = [trial.result] + ([again] if again is not None and again.status == "ok" else [])
            outcome.winner = candidate
            outcome.winner_speed = sum(self._speed(r) for r in runs) / len(runs)
            outcome.parity = verdict or "not checked"
            outcome.plan = self.plan_for(candidate)
            break
        outcome.trials = self.trials

    def _parity(self, candidate: Candidate, result: TrialResult, baseline: TrialResult) -> str | None:
        """``candidate``'s losses against the baseline's, step by step: "within ..." or "FAILED: ...". None when
        it cannot be checked: no losses, or two runs of one candidate already differ (an unseeded model)."""
        precision = candidate.get("precision") or self.base["strategy"].get("precision", "fp32")
        rtol = PARITY_RTOL.get(precision, PARITY_RTOL["bf16"])
        if not result.losses or not baseline.losses:
            return None
        first, second = self.repeated or (None, None)
        if first is not None and second is not None and _worst(second.losses, first.losses) > PARITY_RTOL["fp32"]:
            return None
        worst = _worst(result.losses, baseline.losses)
        tolerance = f"tolerance {rtol:g} in {precision}"
        if worst <= rtol:
            steps = min(len(result.losses), len(baseline.losses))
            return f"loss within {worst:.1e} of the baseline's over {steps} steps ({tolerance})"
        return f"FAILED: its loss differs from the baseline's by {worst:.1e} of it ({tolerance})"

    def _speed(self, result: TrialResult | None) -> float:
        """What the search ranks by: the steady samples per second, or, for a declared run length, that run's
        samples over its time with the trial's startup (compilation) spent once."""
        if result is None or result.status != "ok" or not result.samples_per_s:
            return 0.0
        steps = self.setup.run_steps
        if steps is None or result.step_s is None or result.samples_per_step is None:
            return result.samples_per_s
        return result.samples_per_step * steps / ((result.startup_s or 0.0) + result.step_s * steps)


def _worst(mine: tuple[float, ...], theirs: tuple[float, ...]) -> float:
    """The largest relative difference of two loss curves over the steps both have."""
    pairs = list(zip(mine, theirs, strict=False))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else 0.0
