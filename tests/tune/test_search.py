"""The search's decisions, on a fake trial runner (the product path runs the script through `redline run`:
tests/tune/test_tune_cli.py): the largest micro-batch that fits a device's memory by binary search, pruning by
the measured peaks, loss parity, the journal's resume and cache."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.tune.journal import Journal
from redline.tune.report import html_report
from redline.tune.search import NOT_CHECKED, Budget, Parity, ParityVerdict, Tuner
from redline.tune.space import Machine, default_plan
from redline.tune.trial import Setup, TrialResult

MACHINE = Machine(cuda=True, bf16=True, cpus_per_rank=4, ranks=1)
PER_RANK = 64
GIB = 2**30


class FakeDevice:
    """A GPU with ``memory`` bytes: a micro-batch's peak is 1 GiB of weights plus 0.5 GiB per sample; above
    the memory the run goes out of memory (as the runtime reports it: it went on smaller). Speed grows with the
    micro-batch; fp16 is 1.5x as fast, and its losses are ``fp16_loss_error`` off the baseline's (no losses at all
    without ``losses``: a script that reports none)."""

    def __init__(self, memory: float, fp16_loss_error: float = 0.0, losses: bool = True) -> None:
        self.memory = memory
        self.fp16_loss_error = fp16_loss_error
        self.losses = losses
        self.runs: list[dict | None] = []

    def __call__(self, setup: Setup, plan: dict | None, workdir: Path) -> TrialResult:
        self.runs.append(plan)
        strategy = (plan or {}).get("strategy", {"micro_batch": PER_RANK})
        micro_batch = strategy["micro_batch"]
        peak = GIB + micro_batch * GIB / 2
        if peak > self.memory:
            return TrialResult("oom", why=f"micro-batch {micro_batch} ran out of memory")
        fp16 = strategy.get("precision") == "fp16"
        speed = (100 + micro_batch) * (1.5 if fp16 else 1.0)
        error = 1 + (self.fp16_loss_error if fp16 else 0.0)
        return TrialResult(
            "ok",
            samples_per_s=speed,
            step_s=PER_RANK / speed,
            startup_s=0.0,
            peak_memory_bytes=int(peak),
            samples_per_step=PER_RANK,
            losses=tuple(2.0 / (step + 1) * error for step in range(6)) if self.losses else (),
        )


def tuner(
    tmp_path: Path, device: FakeDevice, *, space=None, memory=None, journal=None, base_plan=None, **budget
) -> Tuner:
    setup = Setup(script=__file__)
    return Tuner(
        setup,
        MACHINE,
        {"precision": [None, "fp16"]} if space is None else space,
        journal or Journal(tmp_path / "journal.jsonl", {"script": "test"}),
        tmp_path / "trials",
        budget=Budget(**budget),
        base_plan=base_plan,
        device_memory=memory,
        runner=device,
    )


def micro_batches_run(device: FakeDevice) -> list[int]:
    return [plan["strategy"]["micro_batch"] for plan in device.runs if plan is not None]


def test_the_largest_micro_batch_that_fits_is_found_by_binary_search(tmp_path: Path) -> None:
    """A base plan of 8 x 8 accumulated per rank on a device of 20 GiB, where up to 37 samples fit: binary
    search over 64's divisors finds 32 (17 GiB) asking 64 (out of memory) and 32, then 16, in case it is
    faster; never all seven. The winner is the fastest that fits, its plan 32 x 2: the same batch."""
    base = default_plan(MACHINE, PER_RANK)
    base["strategy"] |= {"micro_batch": 8, "accumulation": 8}
    device = FakeDevice(memory=20 * GIB)
    outcome = tuner(tmp_path, device, space={}, base_plan=base).tune()
    # the baseline and the default again, the search, the repeat of 32, which beat the default, then the two
    # side by side once more before 32 replaces the default
    assert micro_batches_run(device) == [8, 8, 32, 64, 16, 32, 8, 32]
    statuses = {t.candidate.micro_batch: t.result.status for t in outcome.trials if t.candidate is not None}
    assert statuses == {8: "ok", 32: "ok", 64: "oom", 16: "ok"}
    assert outcome.winner.micro_batch == 32
    assert (outcome.plan["strategy"]["micro_batch"], outcome.plan["strategy"]["accumulation"]) == (32, 2)


def test_a_baseline_that_does_not_run_is_said(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="the script does not run as it is \\(micro-batch 64 ran out of memory\\)"):
        tuner(tmp_path, FakeDevice(memory=20 * GIB)).tune()


def test_a_micro_batch_predicted_over_the_memory_is_pruned_unrun(tmp_path: Path) -> None:
    """After two micro-batches measured (peaks on a line), one whose extrapolated peak is over the device's
    memory less its margin is pruned without running."""
    base = default_plan(MACHINE, PER_RANK)
    base["strategy"] |= {"micro_batch": 8, "accumulation": 8}
    device = FakeDevice(memory=1000 * GIB)
    t = tuner(tmp_path, device, space={}, memory=18 * GIB, base_plan=base)
    outcome = t.tune()
    pruned = [tr for tr in outcome.trials if tr.result.status == "pruned"]
    assert pruned and all(tr.candidate.micro_batch * GIB / 2 + GIB > 18 * GIB * 0.95 for tr in pruned)
    assert not set(micro_batches_run(device)) & {tr.candidate.micro_batch for tr in pruned}
    assert "predicted peak" in pruned[0].result.why


def test_a_faster_config_that_changes_the_loss_is_excluded(tmp_path: Path) -> None:
    device = FakeDevice(memory=1000 * GIB, fp16_loss_error=0.2)  # fp16 1.5x faster, its losses 20% off
    outcome = tuner(tmp_path, device).tune()
    assert outcome.winner.get("precision") is None
    excluded = [t for t in outcome.trials if t.result.status == "parity"]
    assert len(excluded) == 1 and excluded[0].candidate.get("precision") == "fp16"
    assert "differs from the baseline's by 2.0e-01" in excluded[0].result.why
    device = FakeDevice(memory=1000 * GIB, fp16_loss_error=0.01)  # within fp16's tolerance: it wins
    outcome = tuner(tmp_path / "b", device).tune()
    assert outcome.winner.get("precision") == "fp16" and outcome.parity.state is Parity.WITHIN
    assert str(outcome.parity).startswith("loss within 1.0e-02")
    assert outcome.speedup == pytest.approx(1.5)


def test_a_parity_verdict_is_a_state_and_its_reason_said_as_the_report_says_it() -> None:
    within = ParityVerdict(Parity.WITHIN, "loss within 1.0e-03 of the baseline's over 10 steps (tolerance 0.01)")
    failed = ParityVerdict(Parity.FAILED, "its loss differs from the baseline's by 2.0e-01 of it (tolerance 0.01)")
    assert str(within) == within.reason
    assert str(failed) == "FAILED: its loss differs from the baseline's by 2.0e-01 of it (tolerance 0.01)"
    assert str(NOT_CHECKED) == "not checked" and NOT_CHECKED.state is Parity.NOT_CHECKED


def test_without_losses_parity_is_not_checked(tmp_path: Path) -> None:
    outcome = tuner(tmp_path, FakeDevice(memory=1000 * GIB, losses=False)).tune()
    assert outcome.parity is NOT_CHECKED


def test_a_killed_tune_resumes_and_a_finished_one_is_a_cache_hit(tmp_path: Path) -> None:
    complete = FakeDevice(memory=1000 * GIB)
    whole = tuner(tmp_path / "whole", complete).tune()

    class Killed(FakeDevice):  # the tune dies (as with kill -9) during its fourth trial
        def __call__(self, setup, plan, workdir):
            if len(self.runs) == 3:
                raise SystemExit("killed")
            return super().__call__(setup, plan, workdir)

    path = tmp_path / "journal.jsonl"
    with pytest.raises(SystemExit):
        tuner(tmp_path, Killed(memory=1000 * GIB), journal=Journal(path, {"script": "test"})).tune()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["format"] == 1 and len(lines) == 1 + 3 + 1  # the header, 3 trials, the start
    again = FakeDevice(memory=1000 * GIB)
    resumed = tuner(tmp_path, again, journal=Journal(path, {"script": "test"})).tune()
    assert len(again.runs) == len(complete.runs) - 3  # the three trials in the journal are not run again
    assert resumed.winner == whole.winner
    cached = FakeDevice(memory=1000 * GIB)
    hit = tuner(tmp_path, cached, journal=Journal(path, {"script": "test"})).tune()
    assert cached.runs == [] and hit.winner == whole.winner and all(t.cached for t in hit.trials)


def test_the_budget_stops_the_search(tmp_path: Path) -> None:
    device = FakeDevice(memory=1000 * GIB)
    outcome = tuner(tmp_path, device, trials=3).tune()
    assert len(device.runs) == 3 and outcome.stopped == "the budget ran out"
    assert outcome.winner is not None  # the best of what ran


def test_a_candidates_plan_file_is_what_redline_run_reads(tmp_path: Path) -> None:
    """Strategy knobs go to the strategy, the rest to their runtime sections; the batch stays the same."""
    import yaml

    from redline.runtime.config import from_plan_file
    from redline.tune.space import Candidate, restrict, trial_plan

    machine = Machine(cuda=False, bf16=True, cpus_per_rank=2, ranks=1)
    candidate = Candidate(16).with_value("precision", "bf16").with_value("compile", True)
    candidate = candidate.with_value("num_workers", 1).with_value("cpu_threads", 1)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(trial_plan(candidate, base=default_plan(machine, 64), per_rank_batch=64, ranks=1)))
    config = from_plan_file(path)
    assert (config.strategy.micro_batch, config.strategy.accumulation, config.strategy.precision) == (16, 4, "bf16")
    assert config.numerics.compile and config.numerics.cpu_threads == 1 and config.data.num_workers == 1
    assert restrict({"compile": [None, True], "num_workers": [None, 0]}, ["compile=", "num_workers=2"]) == {
        "num_workers": [None, 2]
    }
    with pytest.raises(BadInput, match="--space cpu_threads takes whole numbers from 1; not '0'"):
        restrict({}, ["cpu_threads=0"])


@pytest.mark.parametrize(("cuda", "gpus"), [(False, 0), (True, 1)])
def test_a_tuned_plan_asks_the_queue_for_the_gpus_it_ran_on(tmp_path: Path, cuda: bool, gpus: int) -> None:
    """The quick start's `redline tune -o tuned.yaml` then `redline submit --plan tuned.yaml`: on a machine
    without a GPU the plan is a CPU plan and its job asks none (on main it asked 1, which the queue refused)."""
    import yaml

    from conftest import run_cli
    from redline.tune.space import Candidate, trial_plan

    machine = Machine(cuda=cuda, bf16=True, cpus_per_rank=2, ranks=1)
    path = tmp_path / "tuned.yaml"
    path.write_text(
        yaml.safe_dump(trial_plan(Candidate(16), base=default_plan(machine, 64), per_rank_batch=64, ranks=1))
    )
    queued = run_cli(
        "submit", "--plan", str(path), "--dry-run", "--json", "--", "true", env={"REDLINE_QUEUE_DIR": "/nonexistent"}
    )
    assert queued.returncode == 0, queued.stderr
    assert json.loads(queued.stdout)["gpus"] == gpus


def test_the_base_plans_memory_slope_prunes_before_a_second_micro_batch_is_measured(tmp_path: Path) -> None:
    """A plan at micro-batch 8 whose activations are 0.5 GiB per sample, measured at 5 GiB there (the default's
    repeat), on a device of 14 GiB: 32 (17 GiB on the plan's slope) is pruned unrun (so 64 is never asked),
    16 (9 GiB) runs and wins."""
    base = default_plan(MACHINE, PER_RANK)
    base["strategy"] |= {"micro_batch": 8, "accumulation": 8}
    base["predicted"] = {"memory_bytes": {"allocated": 5 * GIB, "activations": 4 * GIB, "temporary": 0.0}}
    device = FakeDevice(memory=1000 * GIB)  # nothing would run out: what is not run was pruned
    outcome = tuner(tmp_path, device, space={}, base_plan=base, memory=14 * GIB).tune()
    pruned = {t.candidate.micro_batch: t.result.why for t in outcome.trials if t.result.status == "pruned"}
    why = "predicted peak 17.00 GiB (from the plan's memory, measured at micro-batch 8) over 13.30 GiB"
    assert set(pruned) == {32} and why in pruned[32]
    assert micro_batches_run(device) == [8, 8, 16, 16, 8, 16] and outcome.winner.micro_batch == 16


class NoisyDevice:
    """A device on which every config runs at 100 samples/s, but for those in ``gains`` (a strategy field and
    its value: that many times as fast), each run off by a random factor within +-``noise``; a config in
    ``lucky`` has its first run that many times as fast again (a run that met a quiet machine)."""

    def __init__(self, gains: dict, noise: float, seed: int, lucky: dict | None = None) -> None:
        self.gains = gains
        self.noise = noise
        self.lucky = lucky or {}
        self.random = random.Random(seed)
        self.seen: set[tuple] = set()
        self.runs: list[dict | None] = []

    def __call__(self, setup: Setup, plan: dict | None, workdir: Path) -> TrialResult:
        self.runs.append(plan)
        strategy = (plan or {}).get("strategy", {})
        config = (strategy.get("micro_batch", PER_RANK), strategy.get("precision"), strategy.get("checkpointing"))
        speed = 100.0
        for (name, value), factor in self.gains.items():
            speed *= factor if strategy.get(name) == value else 1.0
        for (name, value), factor in self.lucky.items():
            speed *= factor if strategy.get(name) == value and config not in self.seen else 1.0
        self.seen.add(config)
        speed *= 1 + self.random.uniform(-self.noise, self.noise)
        losses = tuple(2.0 / (step + 1) for step in range(6))
        return TrialResult("ok", samples_per_s=speed, step_s=PER_RANK / speed, samples_per_step=PER_RANK, losses=losses)


NOISY_SPACE = {"precision": [None, "fp16"], "checkpointing": [None, "selective", "full"]}
DEFAULT = "mb=64"  # the default's key: the runtime's defaults at the per-rank batch, no knob changed


def test_under_noise_the_truly_faster_config_is_chosen(tmp_path: Path) -> None:
    """Every run off by up to 5%, fp16 truly 25% faster, every other config (micro-batches, checkpointing) the
    same as the default: in each of ten seeded tunes the winner computes in fp16, and the speedup it reports,
    a ratio of medians, is near the truth."""
    for seed in range(10):
        device = NoisyDevice({("precision", "fp16"): 1.25}, noise=0.05, seed=seed)
        outcome = tuner(tmp_path / str(seed), device, space=NOISY_SPACE).tune()
        assert outcome.winner.get("precision") == "fp16", (seed, outcome.winner)
        assert 1.12 < outcome.speedup < 1.4, (seed, outcome.speedup)
        assert 0 < outcome.spread <= 0.11  # the noise measured: two runs within +-5% differ by at most ~10%
        assert len(outcome.scores[outcome.winner.key()]) >= 3 and len(outcome.scores[DEFAULT]) >= 3


def test_a_config_only_noise_faster_than_the_default_does_not_displace_it(tmp_path: Path) -> None:
    """Checkpointing "selective" has one lucky first run, 20% fast, and is the default's speed after; "full" is
    truly 2% faster, under ``MIN_GAIN``: the default wins both (it wins ties), and the lucky one was run again
    before it could lead, and a third time, its two runs disagreeing far beyond the others' (nil) noise."""
    device = NoisyDevice(
        {("checkpointing", "full"): 1.02}, noise=0.0, seed=0, lucky={("checkpointing", "selective"): 1.2}
    )
    outcome = tuner(tmp_path, device, space=NOISY_SPACE).tune()
    assert outcome.winner.key() == DEFAULT and outcome.speedup == pytest.approx(1.0)
    assert outcome.scores["mb=64 checkpointing=selective"] == pytest.approx((120.0, 100.0, 100.0))
    assert outcome.plan["strategy"]["micro_batch"] == PER_RANK and outcome.plan["strategy"]["checkpointing"] == "none"
    page = html_report(outcome, "train.py")  # each config run more than once: its median and spread
    assert "<td>100.0 (spread 20.0% over 3 runs)</td>" in page and "differed by up to 20.0%" in page
    assert "(0.0% but for the config whose runs differed most)" in page


def test_one_slow_spell_neither_hides_a_real_gain_nor_sets_the_bar(tmp_path: Path) -> None:
    """fp16 truly 1.5x as fast, every run off by up to 3%, but fp16's second run falls in a slow spell of the
    machine (35% slow, as a shared CPU shows): its two runs disagree, a third outvotes the slow one, fp16 wins,
    and the noise the later changes are held to is the other configs', not that spell's."""

    class SlowSpell(NoisyDevice):
        def __call__(self, setup, plan, workdir):
            result = super().__call__(setup, plan, workdir)
            fp16 = [p for p in self.runs if p and p["strategy"].get("precision") == "fp16"]
            if len(fp16) == 2 and plan is fp16[-1]:
                return dataclasses.replace(result, samples_per_s=result.samples_per_s * 0.65)
            return result

    for seed in range(5):
        device = SlowSpell({("precision", "fp16"): 1.5}, noise=0.03, seed=seed)
        outcome = tuner(tmp_path / str(seed), device, space=NOISY_SPACE).tune()
        assert outcome.winner.get("precision") == "fp16", (seed, outcome.scores)
        assert outcome.spread > 0.3 and outcome.noise < 0.07, (seed, outcome.spread, outcome.noise)


def test_under_pure_noise_the_default_seldom_loses(tmp_path: Path) -> None:
    """Every config the same speed, every run off by up to 5%: in at most 4 of 40 seeded tunes a config other
    than the default wins (on one measurement each, the fastest of 8 equal configs would win nearly always)."""
    lost = 0
    for seed in range(40):
        outcome = tuner(tmp_path / str(seed), NoisyDevice({}, noise=0.05, seed=seed), space=NOISY_SPACE).tune()
        lost += outcome.winner.key() != DEFAULT
    assert lost <= 4


def test_a_config_that_fails_a_repeat_neither_wins_nor_counts_as_noise(tmp_path: Path) -> None:
    """fp16 is 1.5x as fast but its second run fails: its median counts the failed run as 0, so it does not
    replace the default; and the failure is the config's, not the measurement's: the noise stays 0."""

    class Flaky(FakeDevice):
        def __call__(self, setup, plan, workdir):
            result = super().__call__(setup, plan, workdir)
            fp16_runs = [p for p in self.runs if p and p["strategy"].get("precision") == "fp16"]
            if len(fp16_runs) == 2 and plan is fp16_runs[-1]:
                return TrialResult("failed", why="exit 1: a flaky kernel")
            return result

    outcome = tuner(tmp_path, Flaky(memory=1000 * GIB)).tune()
    assert outcome.winner.key() == DEFAULT and outcome.spread == 0.0
    assert outcome.scores["mb=64 precision=fp16"] == pytest.approx((246.0, 0.0))


def test_a_re_tune_under_noise_replays_the_first_and_runs_nothing(tmp_path: Path) -> None:
    """The journal holds runs the first tune made late (repeats, the final side-by-side runs). A re-tune that
    counted them from the start would judge the early challenges on other medians, take another path and run
    configs the journal lacks; it counts only what it has asked for, so it asks for the same, in the same order."""
    for seed in range(10):
        path = tmp_path / f"{seed}.jsonl"
        device = NoisyDevice({("precision", "fp16"): 1.05}, noise=0.05, seed=seed)
        first = tuner(tmp_path / str(seed), device, space=NOISY_SPACE, journal=Journal(path, {"s": "t"})).tune()
        idle = NoisyDevice({}, noise=0.0, seed=seed)
        again = tuner(tmp_path / str(seed), idle, space=NOISY_SPACE, journal=Journal(path, {"s": "t"})).tune()
        assert idle.runs == [], seed
        assert [(t.label, t.candidate) for t in again.trials] == [(t.label, t.candidate) for t in first.trials]
        assert again.winner == first.winner and again.scores == first.scores
