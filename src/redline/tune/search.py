"""The search: which candidates to run, in which order, and which one wins.

1. The baseline: the script as ``redline run`` runs it (with the base plan if one was given). It fixes the
   global batch, which every candidate keeps. The default (the base plan, or the runtime's defaults, as they
   are) runs again: two runs of one config are the first measure of the noise.
2. Where a journal of the same script on another machine found a winner, that candidate next.
3. The micro-batch: the largest that fits, by binary search over the divisors of the per-rank batch (a trial
   that runs out of memory does not fit; one whose predicted peak, from the measured peaks, is over the
   device's memory is pruned without running; on a CPU the largest is tried first), then the next smaller one.
4. Coordinate descent over the other knobs in ``space.ORDER``: each value of a knob against the leader.
   With the planner (``predict.Predictor``: ``redline tune --model``, or the model a base plan was made for),
   a knob's values are tried fastest-predicted first; one predicted slower than the leader by more than
   ``PREDICTED_SLOWER`` is pruned unrun; activation checkpointing is tried at the largest micro-batch it is
   predicted to let fit; and a micro-batch's peak is predicted from the nearest measured one plus the planner's
   difference. Every prediction is anchored on a measured trial.
5. A config's score is the median of its runs; the noise is the relative spread of one config's runs, the
   largest but one over the configs run more than once: on a shared machine one run in a slow spell can be
   30-40% slower than the config's others, and the largest spread would let that one run set the bar for every
   later change. A challenger whose first run beats the leader's median by more than the noise (and
   ``MIN_GAIN``) runs again, and replaces the leader only when its median still does: one lucky run does not
   move the search.
   Two runs of a config that disagree by more than ``OUTLIER`` times the others' noise get a third, whose
   median outvotes the slow (or lucky) one.
6. The choice: the ``LEADERS`` fastest configs each run ``REPEATS`` times; of those whose median beats the
   default's by more than the noise (the default wins ties), the fastest whose loss matches the baseline's,
   step by step on the same data (loss parity), within a tolerance by precision; one that fails is excluded
   and the next is checked. A script whose losses differ between two runs of the default (it does not seed
   its model) cannot be checked: said. The pick and the default then run once more each, side by side
   (``FINAL_RUNS``), and the pick replaces the default only if its median of three still beats the
   default's by more than the noise: its first run, the one that made it a leader, was the luckiest.

Every trial goes through the journal: a result already there is not run again.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from redline.errors import BadInput
from redline.tune.journal import Journal
from redline.tune.predict import Prediction
from redline.tune.space import Candidate, Machine, default_plan, micro_batches, trial_plan
from redline.tune.trial import Setup, TrialResult, run_trial

# the largest relative step-by-step loss difference a candidate may show against the baseline, by the
# precision the candidate computes in: fp32 differs only by summation order (micro-batches, kernels)
PARITY_RTOL = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2, "fp8": 5e-2}
MIN_GAIN = 0.03  # a change must be this much faster (or beyond the measured noise, if more) to be kept
REPEATS = 2  # runs of a config before it may lead or win: its score is their median
OUTLIER = 2.0  # two runs of a config further apart than this many times the others' noise: one more run decides
LEADERS = 3  # the fastest configs, each run REPEATS times before the choice
FINAL_RUNS = 3  # runs of the chosen config and of the default, before the one replaces the other
MEMORY_MARGIN = 0.05  # of the device's memory, kept free when a predicted peak prunes a micro-batch
# a knob value the planner predicts this much slower than the leader (its step time over the leader's) is not run:
# beyond any run-to-run noise the tune measures, and beyond the planner's usual error on the ratio of two configs
PREDICTED_SLOWER = 1.25
# knob values that save memory: tried at the largest micro-batch they are predicted to let fit
MEMORY_SAVERS = {"checkpointing": ("selective", "full")}

Runner = Callable[[Setup, "dict[str, Any] | None", Path], TrialResult]
Planner = Callable[["dict[str, Any]"], Prediction]  # a trial's plan file -> the planner's prediction


class Parity(Enum):
    """How a candidate's losses compare with the baseline's, step by step (``Tuner._parity``)."""

    WITHIN = "within"  # within its precision's tolerance: it trains as the baseline does
    FAILED = "failed"  # beyond it: excluded from winning, however fast
    NOT_CHECKED = "not checked"  # no losses to compare, or two runs of one config already differ (unseeded)


@dataclass(frozen=True)
class ParityVerdict:
    state: Parity
    reason: str = ""  # the comparison in words, for WITHIN and FAILED

    def __str__(self) -> str:
        """As the report says it: "loss within ...", "FAILED: its loss differs ...", "not checked"."""
        if self.state is Parity.FAILED:
            return f"FAILED: {self.reason}"
        return self.reason or self.state.value


NOT_CHECKED = ParityVerdict(Parity.NOT_CHECKED)


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
    predicted: Prediction | None = None  # the planner's, unanchored (with a planner)


@dataclass
class Outcome:
    baseline: TrialResult
    baseline_speed: float = 0.0  # the default's median, as the search ranks (``Tuner.score``)
    trials: list[Trial] = field(default_factory=list)
    winner: Candidate | None = None
    winner_speed: float | None = None  # the winner's median
    spread: float | None = None  # the largest relative spread of the runs of one config
    noise: float | None = None  # the largest but one (``Tuner.noise``): what a change had to gain beyond
    scores: dict[str, tuple[float, ...]] = field(default_factory=dict)  # each config's runs' speeds, by key
    parity: ParityVerdict = NOT_CHECKED  # the winner's
    plan: dict[str, Any] | None = None  # the winner's plan file
    stopped: str = ""  # why the search ended before it was through: the budget
    predicted_default: float | None = None  # the planner's samples/s for the default and the winner
    predicted_winner: float | None = None

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
        starting: Callable[[str, Candidate | None], None] | None = None,
        planner: Planner | None = None,
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
        self.progress = progress  # each trial, run or from the journal, once it has its result
        self.starting = starting  # (label, candidate) as a trial starts to run: its wait can be said
        self.planner = planner
        self.trials: list[Trial] = []
        self.asked: set[str] = set()  # the journal keys this search has asked for
        self.per_rank_batch = 0
        self.base: dict[str, Any] = {}
        self.stopped = ""  # why the search ended before it was through
        self.repeated: tuple[TrialResult | None, TrialResult | None] | None = None  # two runs of the default

    # ------------------------------------------------------------------------------------------- trials

    def _run(
        self, label: str, candidate: Candidate | None, *, repeat: int = 1, skip: TrialResult | None = None
    ) -> TrialResult | None:
        """The candidate's result: from the journal, else ``skip`` (a verdict without running it), else run (None
        when the budget is spent)."""
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
            pruned = skip or (None if candidate is None else self._pruned(candidate))
            started = time.monotonic()
            # a directory of this process's own: a trial left running by a killed tune cannot write into it
            workdir = self.workdir / f"trial-{len(self.journal.results)}-{os.getpid()}"
            if pruned is None and self.starting is not None:
                self.starting(label, candidate)
            result = pruned or self.runner(self.setup, plan, workdir)
            self.budget.spent_s += time.monotonic() - started
            self.budget.run += pruned is None
            self.journal.record(key, candidate, result)
        trial = Trial(label, candidate, cached or result, cached is not None, self.predict(candidate))
        self.trials.append(trial)
        if self.progress is not None:
            self.progress(trial)
        return trial.result

    def plan_for(self, candidate: Candidate) -> dict[str, Any]:
        return trial_plan(candidate, base=self.base, per_rank_batch=self.per_rank_batch, ranks=self.machine.ranks)

    def predict(self, candidate: Candidate | None) -> Prediction | None:
        """The planner's prediction of ``candidate`` (None without a planner, and for the script without a plan)."""
        if self.planner is None or candidate is None:
            return None
        return self.planner(self.plan_for(candidate))

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
        slope: float
        peak: float
        if len(peaks) >= 2:
            (m1, p1), (m2, p2) = peaks[0], peaks[-1]
            slope, (m, peak), basis = (p2 - p1) / (m2 - m1), (m2, p2), f"the measured micro-batches {m1} and {m2}"
            predicted = peak + slope * (candidate.micro_batch - m)
        elif self.planner is not None:
            predicted, basis = self._anchored_peak(candidate)
        elif planned is not None:
            slope, (m, peak) = planned[0], peaks[-1] if peaks else planned[1]
            basis = f"the plan's memory, measured at micro-batch {m}" if peaks else "the plan's memory"
            predicted = peak + slope * (candidate.micro_batch - m)
        else:
            return None
        room = self.device_memory * (1 - MEMORY_MARGIN)
        if predicted <= room:
            return None
        why = f"predicted peak {predicted / 2**30:.2f} GiB (from {basis}) over {room / 2**30:.2f} GiB"
        return TrialResult("pruned", why=why)

    def _anchored_peak(self, candidate: Candidate) -> tuple[float, str]:
        """The planner's peak for ``candidate``, anchored on the measured peak of the nearest config that ran (the
        same knobs first, then the nearest micro-batch): that peak plus the planner's difference between the two.
        Nothing measured yet: the planner's own figure."""
        predicted = self.predict(candidate)
        assert predicted is not None
        measured = [
            t.candidate
            for t in self.trials
            if t.candidate is not None and t.result.status == "ok" and t.result.peak_memory_bytes
        ]
        if not measured:
            return predicted.allocated_bytes, "the planner"
        nearest = min(
            measured,
            key=lambda c: (c.knobs != candidate.knobs, abs(c.micro_batch - candidate.micro_batch)),
        )
        result = self.journal.get(nearest.key())
        anchor = self.predict(nearest)
        assert result is not None and result.peak_memory_bytes and anchor is not None
        peak = result.peak_memory_bytes + predicted.allocated_bytes - anchor.allocated_bytes
        return peak, f"the planner, anchored on {nearest.key()}'s measured peak"

    def _slower(self, candidate: Candidate, leader: Candidate) -> TrialResult | None:
        """A pruned result for a candidate the planner, corrected by the leader's measured micro-batches
        (``_corrected_step_s``), predicts slower than the leader by more than ``PREDICTED_SLOWER``; None where
        it may be faster, or cannot tell."""
        if self.planner is None:
            return None
        mine, theirs = self._corrected_step_s(candidate, leader.knobs), self._corrected_step_s(leader, leader.knobs)
        if mine <= theirs * PREDICTED_SLOWER:
            return None
        expected = self.score(leader) * theirs / mine
        why = (
            f"predicted {mine / theirs:.2f}x the leader's step time "
            f"(about {expected:,.0f} samples/s against its measured {self.score(leader):,.0f})"
        )
        return TrialResult("pruned", why=why)

    def _corrected_step_s(self, candidate: Candidate, family: tuple[tuple[str, Any], ...]) -> float:
        """The planner's step time for ``candidate``, corrected as ``redline plan --calibrate`` corrects it: a
        line measured = a x planned + b x micro-batches a step, fitted on the measured configs with the knobs
        ``family`` (the micro-batch search's, at several accumulations): ``b`` is what each micro-batch costs
        beyond the planner's roofline (eager PyTorch's launches, the step's Python). One accumulation measured,
        or a fit that makes no sense (b < 0): the ratio alone, b = 0."""
        predicted = self.predict(candidate)
        assert predicted is not None
        points = []
        for c in self._candidates():
            result = self.journal.get(c.key())
            if c.knobs == family and result is not None and result.status == "ok" and result.step_s:
                planned = self.predict(c)
                assert planned is not None
                points.append((planned.step_s, self.per_rank_batch / c.micro_batch, result.step_s))
        scale, per_micro_batch = _fit_steps(points)
        return scale * predicted.step_s + per_micro_batch * self.per_rank_batch / candidate.micro_batch

    def _ranked(self, knob: str, values: list[Any], leader: Candidate) -> list[Any]:
        """A knob's values in the order to try them: fastest-predicted first with a planner (ties as given)."""
        if self.planner is None:
            return values
        return sorted(values, key=lambda v: self._corrected_step_s(self._knob_candidate(leader, knob, v), leader.knobs))

    def _knob_candidate(self, leader: Candidate, knob: str, value: Any) -> Candidate:
        """The leader with ``knob`` at ``value``; a value that saves memory (``MEMORY_SAVERS``), with a planner
        and a device whose memory it knows, at the largest micro-batch predicted to fit under it (when larger)."""
        candidate = leader.with_value(knob, value)
        if self.planner is None or self.device_memory is None or value not in MEMORY_SAVERS.get(knob, ()):
            return candidate
        for size in micro_batches(self.per_rank_batch):
            if size <= leader.micro_batch:
                break
            larger = candidate.with_micro_batch(size)
            if self._anchored_peak(larger)[0] <= self.device_memory * (1 - MEMORY_MARGIN):
                return larger
        return candidate

    def _planned_line(self) -> tuple[float, tuple[int, float]] | None:
        """The base plan's memory as a line in the micro-batch: (bytes per sample, (its micro-batch, its
        allocated bytes)); None without a plan that predicted it."""
        memory = ((self.base_plan or {}).get("predicted") or {}).get("memory_bytes") or {}
        if "allocated" not in memory:
            return None
        micro_batch = int(self.base["strategy"]["micro_batch"])
        per_sample = (memory.get("activations", 0.0) + memory.get("temporary", 0.0)) / micro_batch
        return per_sample, (micro_batch, float(memory["allocated"]))

    # ------------------------------------------------------------------------------------------- scores

    def runs(self, candidate: Candidate) -> list[float]:
        """The speeds of the runs of ``candidate`` this search has asked for so far (its key, then ``#2``,
        ``#3``...), from the journal; a run that did not end ``ok`` counts as 0, so a config that fails now and
        then does not win on its good runs. Runs the journal holds from later in an earlier search do not count
        yet: a re-tune replays the same decisions, so it asks for nothing the journal lacks."""
        speeds, key = [], candidate.key()
        while key in self.asked and (result := self.journal.get(key)) is not None:
            speeds.append(self._speed(result))
            key = f"{candidate.key()} #{len(speeds) + 1}"
        return speeds

    def score(self, candidate: Candidate) -> float:
        """The median of the candidate's runs (0 before any): what it is ranked and compared by."""
        speeds = self.runs(candidate)
        return statistics.median(speeds) if speeds else 0.0

    def spreads(self, *, besides: Candidate | None = None) -> list[float]:
        """The relative spread, (fastest - slowest) / median, of the runs of each config (but ``besides``) that
        ran to the end more than once in this search (a failed run is the config's fault, not the
        measurement's)."""
        ok = [[speed for speed in self.runs(c) if speed > 0] for c in self._candidates() if c != besides]
        return [spread(speeds) for speeds in ok if len(speeds) > 1]

    def noise(self, *, besides: Candidate | None = None) -> float | None:
        """The spread runs of one config show, one slow spell aside: the largest of ``spreads`` but the
        largest, once three or more configs ran twice (one run in a slow spell makes its config's spread the
        largest, and would otherwise set the bar for every later change); None before any config ran twice."""
        spreads = sorted(self.spreads(besides=besides))
        return spreads[-2] if len(spreads) >= 3 else spreads[-1] if spreads else None

    def _beats(self, candidate: Candidate, incumbent: Candidate) -> bool:
        """``candidate``'s median is faster than ``incumbent``'s by more than the noise (and ``MIN_GAIN``)."""
        gain = max(MIN_GAIN, self.noise() or 0.0)
        return self.score(candidate) > self.score(incumbent) * (1 + gain)

    def _repeat(self, label: str, candidate: Candidate, runs: int = REPEATS) -> None:
        """Run ``candidate`` again until it has ``runs`` runs (or the budget is spent); two that disagree by more
        than ``OUTLIER`` times the other configs' noise (``MIN_GAIN`` before any) get a third."""
        for repeat in range(len(self.runs(candidate)) + 1, runs + 1):
            if self._run(label, candidate, repeat=repeat) is None:
                return
        speeds = self.runs(candidate)
        others = max(MIN_GAIN, self.noise(besides=candidate) or 0.0)
        if len(speeds) == 2 and min(speeds) > 0 and spread(speeds) > OUTLIER * others:
            self._run(label, candidate, repeat=3)

    def _candidates(self) -> list[Candidate]:
        """Every config this search has a trial of, in the order first tried."""
        return list(dict.fromkeys(t.candidate for t in self.trials if t.candidate is not None))

    # ------------------------------------------------------------------------------------------- search

    def tune(self) -> Outcome:
        baseline = self._run("baseline", None)
        if baseline is None or baseline.status != "ok":
            why = baseline.why if baseline is not None else "the budget allows no trial"
            raise BadInput(f"the script does not run as it is ({why}): make `redline run` run it first")
        self.per_rank_batch = self._per_rank_batch(baseline)
        self.base = self.base_plan or default_plan(self.machine, self.per_rank_batch)
        start = Candidate(int(self.base["strategy"]["micro_batch"]))
        if self.journal.get(start.key()) is None:  # the base plan (or the defaults) as they are: the baseline
            self.journal.record(start.key(), start, baseline)
        self.asked.add(start.key())
        # the default again: the first measure of the noise, and a median for the default, which wins ties
        self._repeat("repeat", start)
        self.repeated = (baseline, self.journal.get(start.key() + " #2"))
        leader = start
        elsewhere = self.journal.best_elsewhere()
        if elsewhere is not None and elsewhere.micro_batch in micro_batches(self.per_rank_batch):
            leader = self._challenge("another machine's best", leader, elsewhere)
        leader = self._search_micro_batch(leader)
        for knob, values in self.space.items():
            for value in self._ranked(knob, values, leader):
                if value != leader.get(knob) and not self.stopped:
                    candidate = self._knob_candidate(leader, knob, value)
                    leader = self._challenge(knob, leader, candidate, skip=self._slower(candidate, leader))
        outcome = Outcome(baseline)
        self._choose(outcome, baseline, start)
        return outcome

    def _challenge(
        self, label: str, leader: Candidate, candidate: Candidate, skip: TrialResult | None = None
    ) -> Candidate:
        """``candidate`` in place of ``leader`` when its median over ``REPEATS`` runs beats the leader's by
        more than the noise. A first run that does not beat it is not repeated: the repeats go to the
        candidates that may win. ``skip``: the planner's verdict, which stands for the run."""
        if self._run(label, candidate, skip=skip) is None:
            self.stopped = "the budget ran out"
            return leader
        if not self._beats(candidate, leader):
            return leader
        self._repeat("confirm", candidate)
        return candidate if self._beats(candidate, leader) else leader

    def _per_rank_batch(self, baseline: TrialResult) -> int:
        if self.base_plan is not None:
            strategy = self.base_plan["strategy"]
            return int(strategy["micro_batch"]) * int(strategy.get("accumulation", 1))
        assert baseline.samples_per_step is not None
        return baseline.samples_per_step // self.machine.ranks

    def _search_micro_batch(self, leader: Candidate) -> Candidate:
        """The largest micro-batch that fits (binary search over the per-rank batch's divisors, largest first:
        a micro-batch that fits means every smaller one does), then the next smaller one; each that ran
        challenges the leader, the fastest first. On a CPU, whose memory seldom limits, the largest is tried
        first: when it fits, the search is over at once."""
        sizes = micro_batches(self.per_rank_batch)
        speeds: dict[int, float] = {}

        def fits(size: int) -> bool:
            result = self._run("micro-batch", leader.with_micro_batch(size))
            speeds[size] = self._speed(result)
            return result is not None and result.status == "ok"

        low, high = 0, len(sizes) - 1
        if not self.machine.cuda and fits(sizes[0]):
            high = 0
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
        incumbent = leader
        for size in sorted(speeds, key=lambda size: -speeds[size]):
            if speeds[size] > 0 and size != incumbent.micro_batch and not self.stopped:
                leader = self._challenge("micro-batch", leader, incumbent.with_micro_batch(size))
        return leader

    def _leaders(self, start: Candidate) -> list[Candidate]:
        """The configs that may win, fastest median first: the ``LEADERS`` fastest each run ``REPEATS`` times
        (a leader whose repeat falls back lets the next in; one already slower than the fastest beyond the
        noise is not repeated), then those whose median beats the default's by more than the noise, and the
        default itself, which wins ties."""
        ok = [c for c in dict.fromkeys([start, *self._candidates()]) if any(s > 0 for s in self.runs(c))]
        for _ in range(LEADERS * REPEATS):
            ranked = sorted(ok, key=self.score, reverse=True)
            # those not already slower than the fastest beyond the noise
            short = [c for c in ranked[:LEADERS] if len(self.runs(c)) < REPEATS and not self._beats(ranked[0], c)]
            if not short or not self.budget.allows():
                break
            self._repeat("repeat", short[0])
        ranked = sorted(ok, key=self.score, reverse=True)
        return [c for c in ranked if c == start or (len(self.runs(c)) >= REPEATS and self._beats(c, start))]

    def _choose(self, outcome: Outcome, baseline: TrialResult, start: Candidate) -> None:
        """The fastest leader that trains as the baseline does and, run once more side by side with the default
        (``FINAL_RUNS`` each: a median of three is not carried by the one lucky run that made it a leader),
        still beats the default beyond the noise; else the default."""
        winner, verdict = start, self._parity(start, baseline, baseline)
        for candidate in self._leaders(start)[:LEADERS]:
            if candidate == start:
                break
            result = self.journal.get(candidate.key())
            assert result is not None
            checked = self._parity(candidate, result, baseline)
            if checked.state is Parity.FAILED:
                self.trials.append(Trial("parity", candidate, TrialResult("parity", why=checked.reason), False))
                continue
            self._repeat("against the default", start, FINAL_RUNS)
            self._repeat("against the default", candidate, FINAL_RUNS)
            if self._beats(candidate, start):
                winner, verdict = candidate, checked
            break
        outcome.winner = winner
        outcome.winner_speed = self.score(winner)
        outcome.parity = verdict
        outcome.plan = self.plan_for(winner)
        outcome.baseline_speed = self.score(start)
        outcome.spread = max(self.spreads(), default=None)
        outcome.noise = self.noise()
        outcome.stopped = self.stopped
        outcome.trials = self.trials
        outcome.scores = {c.key(): tuple(self.runs(c)) for c in dict.fromkeys([start, *self._candidates()])}
        if self.planner is not None:
            outcome.predicted_default = self.planner(self.plan_for(start)).samples_per_s
            outcome.predicted_winner = self.planner(self.plan_for(winner)).samples_per_s

    def _parity(self, candidate: Candidate, result: TrialResult, baseline: TrialResult) -> ParityVerdict:
        """``candidate``'s losses against the baseline's, step by step, within the tolerance of its precision or
        not; not checked without losses, or where two runs of one candidate already differ (an unseeded model)."""
        precision = candidate.get("precision") or self.base["strategy"].get("precision", "fp32")
        rtol = PARITY_RTOL.get(precision, PARITY_RTOL["bf16"])
        if not result.losses or not baseline.losses:
            return NOT_CHECKED
        first, second = self.repeated or (None, None)
        if first is not None and second is not None and _worst(second.losses, first.losses) > PARITY_RTOL["fp32"]:
            return NOT_CHECKED
        worst = _worst(result.losses, baseline.losses)
        tolerance = f"tolerance {rtol:g} in {precision}"
        if worst <= rtol:
            steps = min(len(result.losses), len(baseline.losses))
            return ParityVerdict(
                Parity.WITHIN, f"loss within {worst:.1e} of the baseline's over {steps} steps ({tolerance})"
            )
        return ParityVerdict(Parity.FAILED, f"its loss differs from the baseline's by {worst:.1e} of it ({tolerance})")

    def _speed(self, result: TrialResult | None) -> float:
        """What the search ranks by: the steady samples per second, or, for a declared run length, that run's
        samples over its time with the trial's startup (compilation) spent once."""
        if result is None or result.status != "ok" or not result.samples_per_s:
            return 0.0
        steps = self.setup.run_steps
        if steps is None or result.step_s is None or result.samples_per_step is None:
            return result.samples_per_s
        return result.samples_per_step * steps / ((result.startup_s or 0.0) + result.step_s * steps)


def _fit_steps(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) of measured = a x planned + b x micro-batches, least squares over (planned, micro-batches,
    measured) points; (median measured/planned, 0) where the micro-batches do not vary or b comes out negative;
    (1, 0) without a point."""
    if not points:
        return 1.0, 0.0
    ratio = statistics.median(measured / planned for planned, _, measured in points)
    if len({count for _, count, _ in points}) < 2:
        return ratio, 0.0
    import numpy as np

    (scale, per_micro_batch), *_ = np.linalg.lstsq(
        np.array([[planned, count] for planned, count, _ in points]),
        np.array([measured for *_, measured in points]),
        rcond=None,
    )
    return (float(scale), float(per_micro_batch)) if scale > 0 and per_micro_batch >= 0 else (ratio, 0.0)


def spread(speeds: list[float] | tuple[float, ...]) -> float:
    """(fastest - slowest) / median of a config's runs."""
    middle = statistics.median(speeds)
    return (max(speeds) - min(speeds)) / middle if middle > 0 else 0.0


def _worst(mine: tuple[float, ...], theirs: tuple[float, ...]) -> float:
    """The largest relative difference of two loss curves over the steps both have."""
    pairs = list(zip(mine, theirs, strict=False))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else 0.0
