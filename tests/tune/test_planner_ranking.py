"""The planner in the tune's search, on a fake device and a fake planner (the product path: `redline tune
--model`, tests/tune/test_tune_cli.py): knob values ordered by predicted speed, a value predicted much slower
pruned unrun, activation checkpointing tried at the micro-batch it lets fit, every prediction anchored on a
measured trial."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline.tune.journal import Journal
from redline.tune.predict import Prediction
from redline.tune.search import PREDICTED_SLOWER, Budget, Tuner
from redline.tune.space import Machine, default_plan
from redline.tune.trial import Setup, TrialResult

MACHINE = Machine(cuda=True, bf16=True, cpus_per_rank=4, ranks=1)
PER_RANK = 64
GIB = 2**30
SLOWDOWN = {None: 1.0, "none": 1.0, "selective": 0.95, "full": 0.75}  # the forward rerun, on the step's speed


def peak(strategy: dict) -> float:
    """1 GiB of weights and 0.5 GiB per sample; full checkpointing keeps a tenth of that."""
    per_sample = GIB / 20 if strategy.get("checkpointing") == "full" else GIB / 2
    return GIB + strategy["micro_batch"] * per_sample


def speed(strategy: dict) -> float:
    """Samples/s grow with the micro-batch (fewer, larger micro-batches per step); checkpointing slows a step."""
    return (100 + 4 * strategy["micro_batch"]) * SLOWDOWN[strategy.get("checkpointing")]


class Device:
    """A GPU with ``memory`` bytes running ``speed`` and ``peak``; above its memory a run goes out of memory."""

    def __init__(self, memory: float) -> None:
        self.memory = memory
        self.runs: list[dict] = []

    def __call__(self, setup: Setup, plan: dict | None, workdir: Path) -> TrialResult:
        strategy = (plan or {}).get("strategy", {"micro_batch": 8})
        self.runs.append(strategy)
        if peak(strategy) > self.memory:
            return TrialResult("oom", why=f"micro-batch {strategy['micro_batch']} ran out of memory")
        samples_per_s = speed(strategy)
        return TrialResult(
            "ok",
            samples_per_s=samples_per_s,
            step_s=PER_RANK / samples_per_s,
            startup_s=0.0,
            peak_memory_bytes=int(peak(strategy)),
            samples_per_step=PER_RANK,
            losses=(2.0, 1.0, 0.5),
        )


class Planner:
    """The planner's view: the device's speeds (a constant factor off) and peaks (``offset`` off): anchored on
    a measured trial, both errors cancel."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self, plan: dict) -> Prediction:
        strategy = plan["strategy"]
        samples_per_s = speed(strategy) * 3  # three times too fast: only ratios count
        return Prediction(PER_RANK / samples_per_s, samples_per_s, peak(strategy) + self.offset)


def tune(tmp_path: Path, device: Device, planner: Planner | None, space: dict, **budget) -> Tuner:
    base = default_plan(MACHINE, PER_RANK)
    base["strategy"] |= {"micro_batch": 8, "accumulation": 8}
    tuner = Tuner(
        Setup(script=__file__),
        MACHINE,
        space,
        Journal(tmp_path / "journal.jsonl", {"script": "test"}),
        tmp_path / "trials",
        base_plan=base,
        budget=Budget(**budget),
        device_memory=int(device.memory),
        runner=device,
        planner=planner,
    )
    return tuner


def test_checkpointing_runs_at_the_micro_batch_it_lets_fit_and_wins(tmp_path: Path) -> None:
    """20 GiB: without checkpointing 32 samples fit (17 GiB) and 64 do not; full checkpointing fits 64 (4.2
    GiB) and, one micro-batch a step instead of two, is faster despite the rerun (267 against 228 samples/s).
    The planner overestimates every peak by 16 GiB: alone, it would say 64 does not fit under checkpointing
    (20.2 GiB), but anchored on the leader's measured peak its difference is right."""
    device = Device(memory=20 * GIB)
    outcome = tune(tmp_path, device, Planner(offset=16 * GIB), {"checkpointing": [None, "full"]}).tune()
    assert {"micro_batch": 64, "checkpointing": "full"}.items() <= next(
        s for s in device.runs if s.get("checkpointing") == "full"
    ).items()
    assert outcome.winner.get("checkpointing") == "full" and outcome.winner.micro_batch == 64
    assert (outcome.plan["strategy"]["micro_batch"], outcome.plan["strategy"]["accumulation"]) == (64, 1)
    assert outcome.predicted_winner == speed(outcome.plan["strategy"]) * 3
    # without the planner the search tries checkpointing at the leader's micro-batch, where it only costs
    device = Device(memory=20 * GIB)
    outcome = tune(tmp_path / "unplanned", device, None, {"checkpointing": [None, "full"]}).tune()
    assert [s["micro_batch"] for s in device.runs if s.get("checkpointing") == "full"] == [32]
    assert outcome.winner.get("checkpointing") is None and outcome.winner.micro_batch == 32


def test_a_value_predicted_much_slower_is_pruned_unrun(tmp_path: Path) -> None:
    """With room for the whole batch, full checkpointing can only rerun the forward: predicted 1.33x the
    leader's step, over ``PREDICTED_SLOWER``, it is pruned without a run and said why; selective (1.05x) runs,
    and runs first, being predicted the faster of the two."""
    assert 1 / SLOWDOWN["full"] > PREDICTED_SLOWER > 1 / SLOWDOWN["selective"]
    device = Device(memory=200 * GIB)
    outcome = tune(tmp_path, device, Planner(), {"checkpointing": [None, "full", "selective"]}).tune()
    assert not any(s.get("checkpointing") == "full" for s in device.runs)
    knob_trials = [t for t in outcome.trials if t.label == "checkpointing"]
    assert [(t.candidate.get("checkpointing"), t.result.status) for t in knob_trials] == [
        ("selective", "ok"),
        ("full", "pruned"),
    ]
    assert knob_trials[1].result.why.startswith("predicted 1.33x the leader's step time")
    assert all(t.predicted is not None for t in outcome.trials if t.candidate is not None)


def test_a_micro_batch_is_pruned_by_the_planner_anchored_on_the_nearest_measured_peak(tmp_path: Path) -> None:
    """The planner underestimates every peak by 10 GiB: on its own it would run 32 (7 GiB predicted, 17 real)
    on 12 GiB. Anchored on the baseline's measured 5 GiB at micro-batch 8, it predicts 17 and prunes 32 unrun;
    16 (9 GiB) runs and is the largest that fits."""
    device = Device(memory=12 * GIB)
    outcome = tune(tmp_path, device, Planner(offset=-10 * GIB), {}).tune()
    assert sorted({s["micro_batch"] for s in device.runs}) == [8, 16]
    pruned = next(t for t in outcome.trials if t.candidate is not None and t.candidate.micro_batch == 32)
    assert pruned.result.status == "pruned" and "anchored on mb=8's measured peak" in pruned.result.why
    assert "predicted peak 17.00 GiB" in pruned.result.why
    assert outcome.winner.micro_batch == 16


class OverheadDevice(Device):
    """A step of 0.2 s of compute (4/3 of it under full checkpointing) and 0.1 s for each micro-batch: the
    launches and Python a roofline planner does not see."""

    def __call__(self, setup: Setup, plan: dict | None, workdir: Path) -> TrialResult:
        result = super().__call__(setup, plan, workdir)
        if result.status != "ok":
            return result
        strategy = self.runs[-1]
        step_s = 0.2 * (4 / 3 if strategy.get("checkpointing") == "full" else 1)
        step_s += 0.1 * PER_RANK / strategy["micro_batch"]
        return TrialResult(**(result.to_dict() | {"samples_per_s": PER_RANK / step_s, "step_s": step_s}))


class FlatPlanner(Planner):
    """A roofline: the same compute at every micro-batch, 4/3 of it under full checkpointing."""

    def __call__(self, plan: dict) -> Prediction:
        strategy = plan["strategy"]
        step_s = 0.05 * (4 / 3 if strategy.get("checkpointing") == "full" else 1)
        return Prediction(step_s, PER_RANK / step_s, peak(strategy))


def test_the_planner_is_corrected_by_the_measured_micro_batches_before_it_prunes(tmp_path: Path) -> None:
    """The planner sees full checkpointing as 1.33x the step, over ``PREDICTED_SLOWER``; but the micro-batch
    search measured 0.1 s per micro-batch it does not see (1.0, 0.6 and 0.4 s at 8, 4 and 2 micro-batches a
    step), and the line fitted through them says one micro-batch of 64 under checkpointing (0.37 s) beats the
    leader's two of 32 (0.40 s): it runs, and wins."""
    device = OverheadDevice(memory=20 * GIB)
    outcome = tune(tmp_path, device, FlatPlanner(), {"checkpointing": [None, "full"]}).tune()
    assert outcome.winner.get("checkpointing") == "full" and outcome.winner.micro_batch == 64
    assert outcome.speedup == pytest.approx(1.0 / (0.2 * 4 / 3 + 0.1))  # against the default, 8 x 8
