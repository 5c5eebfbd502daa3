"""redline tune against an exhaustive grid over the same space, side by side in one run on this machine.

For each target script, every candidate of the space is run once, as the tune runs a trial (``run_trial``:
`redline run` with the candidate's plan file, warm-up plus measured steps), and so is the script with no plan;
then a tune over the same space with a fresh journal. The grid scores each config on that one run: its best is
the fastest of many noisy measurements, which flatters it. So the tune's pick, the grid's best and the script
with no plan then run again, side by side, ``--rounds`` rounds each (3), in turn (a slow spell of the machine falls
on all three), and the ratios are of those medians. Reported per target:

- pick/best: the side-by-side median of the tune's pick over the grid's best's, the issue's target >= 0.95
  (and the same ratio on the grid's single runs, for reference);
- time: the tune's trial time over the grid's (launch to exit of every trial; the side-by-side runs are in
  neither), target <= 0.25;
- speedup: the tune's pick over `redline run` with no plan, both side-by-side medians, target >= 1.5 where the
  defaults leave gains;
- the trial counts, and the spread of the side-by-side runs ((fastest - slowest) / median, the largest of the
  three): a ratio within it is a tie.

    python benchmarks/tune_vs_grid.py [--targets cnn,gpt,hf-gpt2] [--trial-steps 4] [--warmup 2] [--rounds 3]
                                      [--json]

``--trial-steps``: the measured optimizer steps of every trial, after ``--warmup`` unmeasured ones (2, as
`redline tune` runs them), the grid's and the tune's alike; on a noisy machine longer trials rank closer
configs, for more time.

The space (``SPACE``): the micro-batch over every divisor of the batch, precision (fp32, bf16), DataLoader
workers (the script's, 1) and CPU threads (torch's, 1); not compile, as a compiled CPU trial spends most of its
time in the compiler, which would make the grid take hours.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

from redline.errors import BadInput
from redline.tune.journal import Journal
from redline.tune.predict import Predictor, load_profile, on_this_machine
from redline.tune.search import Budget, Tuner, spread
from redline.tune.space import Candidate, Machine, default_plan, default_space, micro_batches, restrict, trial_plan
from redline.tune.trial import Setup, run_trial

ROOT = Path(__file__).resolve().parents[1]
# the tune's default knobs less compile, each at its default and one other value (the grid is their product)
SPACE = ["compile=", "num_workers=1", "cpu_threads=1"]
# each target: the script, its arguments, and its model as `redline tune -m` takes it (the planner's)
TARGETS = {
    "cnn": (
        ROOT / "examples" / "train_cnn.py",
        ("--batch", "64"),
        {"model": "examples.train_cnn:SmallResNet", "input_shape": [3, 32, 32]},
    ),
    "gpt": (
        ROOT / "examples" / "train_gpt.py",
        ("--batch", "32"),
        {"model": "examples.train_gpt:Gpt", "input_shape": [64]},
    ),
    "hf-gpt2": (
        ROOT / "benchmarks" / "tune_targets" / "hf_gpt2.py",
        ("--batch", "16"),
        {"model": "benchmarks.tune_targets.hf_gpt2:build"},
    ),
}


def grid(setup: Setup, machine: Machine, space: dict, per_rank: int, workdir: Path) -> dict[str, tuple]:
    """Every candidate of the space, run once: {key: (samples/s, wall seconds, plan)}."""
    base = default_plan(machine, per_rank)
    knobs = list(space)
    out = {}
    for index, (size, *values) in enumerate(itertools.product(micro_batches(per_rank), *space.values())):
        candidate = Candidate(size)
        for knob, value in zip(knobs, values, strict=True):
            candidate = candidate.with_value(knob, value)
        plan = trial_plan(candidate, base=base, per_rank_batch=per_rank, ranks=1)
        result = run_trial(setup, plan, workdir / f"grid-{index}")
        out[candidate.key()] = (result.samples_per_s or 0.0 if result.status == "ok" else 0.0, result.wall_s, plan)
        print(f"  grid {candidate.key():50} {out[candidate.key()][0]:10.1f} samples/s", file=sys.stderr)
    return out


def side_by_side(setup: Setup, plans: dict[str, dict | None], workdir: Path, rounds: int) -> dict[str, list[float]]:
    """Each plan run ``rounds`` times, in turn: {name: samples/s of each run}."""
    speeds: dict[str, list[float]] = {name: [] for name in plans}
    for index in range(rounds):
        for name, plan in plans.items():
            result = run_trial(setup, plan, workdir / f"again-{name}-{index}")
            speeds[name].append(result.samples_per_s or 0.0 if result.status == "ok" else 0.0)
            print(f"  again {name:10} {speeds[name][-1]:10.1f} samples/s", file=sys.stderr)
    return speeds


def planner(load: dict) -> Predictor | None:
    """The planner for the target's model on this machine, as `redline tune -m` makes it; None (said) where it
    cannot predict here (a CPU without `redline bench compute memory --save`)."""
    try:
        return on_this_machine(load_profile(load), 1)
    except BadInput as exc:
        print(f"  no planner: {exc}", file=sys.stderr)
        return None


def bench(name: str, workdir: Path, *, steps: int, warmup: int, rounds: int) -> dict:
    script, args, load = TARGETS[name]
    setup = Setup(script=str(script), args=args, warmup_steps=warmup, steps=steps, timeout_s=600)
    machine = Machine.here(1)
    space = restrict(default_space(machine), SPACE)
    baseline = run_trial(setup, None, workdir / "baseline")
    per_rank = baseline.samples_per_step
    measured = grid(setup, machine, space, per_rank, workdir)
    journal = Journal(workdir / "journal.jsonl", {"script": name})
    ranking = planner(load)
    outcome = Tuner(setup, machine, space, journal, workdir / "tune", budget=Budget(), planner=ranking).tune()
    best_key = max(measured, key=lambda key: measured[key][0])
    pick = outcome.winner.key() if outcome.winner else None
    plans = {"no-plan": None, "grid-best": measured[best_key][2]}
    if pick != best_key:
        plans["tune-pick"] = outcome.plan
    again = side_by_side(setup, plans, workdir, rounds)
    median = {key: statistics.median(speeds) for key, speeds in again.items()}
    median.setdefault("tune-pick", median["grid-best"])
    tune_s = sum(t.result.wall_s for t in outcome.trials if not t.cached)
    grid_s = sum(wall for _, wall, _ in measured.values()) + baseline.wall_s
    return {
        "target": name,
        "grid_trials": len(measured) + 1,
        "tune_trials": sum(not t.cached for t in outcome.trials),
        "planner": ranking is not None,
        "pruned_by_the_planner": sum(t.result.status == "pruned" for t in outcome.trials),
        "grid_best": best_key,
        "tune_pick": pick,
        "pick_over_best": median["tune-pick"] / median["grid-best"],
        "tune_time_over_grid": tune_s / grid_s,
        "pick_over_no_plan": median["tune-pick"] / median["no-plan"],
        "side_by_side_spread": max(spread(speeds) for speeds in again.values()),
        "side_by_side_samples_per_s": again,
        "grid_pick_over_best": measured[pick][0] / measured[best_key][0] if pick in measured else None,
        "grid_best_samples_per_s": measured[best_key][0],
        "tune_reported_speedup": outcome.speedup,
        "tune_noise": outcome.noise,  # what its decisions used: the largest spread of one config's runs but one
        "tune_spread": outcome.spread,
    }


def add_trial_arguments(parser: argparse.ArgumentParser, *, trial_steps: int, rounds: int) -> None:
    """The options the tune benchmarks share: each trial's measured and warm-up steps, the side-by-side rounds."""
    parser.add_argument("--trial-steps", type=int, default=trial_steps)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", action="store_true")


def parse_trial_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments, the trial options checked (a usage error where one is out of range)."""
    args = parser.parse_args()
    if args.trial_steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--trial-steps and --rounds must be at least 1, --warmup at least 0")
    return args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default=",".join(TARGETS))
    add_trial_arguments(parser, trial_steps=4, rounds=3)
    args = parse_trial_arguments(parser)
    unknown = set(args.targets.split(",")) - set(TARGETS)
    if unknown:
        parser.error(f"unknown target {', '.join(sorted(unknown))}; known: {', '.join(TARGETS)}")
    rows = []
    for name in args.targets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{name}:", file=sys.stderr)
            rows.append(bench(name, Path(tmp), steps=args.trial_steps, warmup=args.warmup, rounds=args.rounds))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(
            f"{r['target']:8} pick/best {r['pick_over_best']:.3f}  time tune/grid {r['tune_time_over_grid']:.3f}  "
            f"pick/no-plan {r['pick_over_no_plan']:.2f}x  trials {r['tune_trials']} of {r['grid_trials']}  "
            f"spread {r['side_by_side_spread']:.1%}  pruned by the planner {r['pruned_by_the_planner']}  "
            f"(pick {r['tune_pick']}; grid best {r['grid_best']})"
        )


if __name__ == "__main__":
    main()
