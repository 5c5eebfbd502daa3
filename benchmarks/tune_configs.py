"""The ground truth a tune is judged against: a few configs of one of `tune_vs_grid.py`'s targets, each run as a
tune trial runs it, in interleaved rounds (a slow spell of the machine falls on every config of a round), with
each config's median, its runs and its ratio to the default's median.

    python benchmarks/tune_configs.py [--target hf-gpt2] [--configs precision=bf16,num_workers=1,mb=8]
                                      [--rounds 4] [--trial-steps 12] [--warmup 2] [--json]

A config is the default (the runtime's defaults at the script's batch) with the changes its spec names, joined
by ``+``: ``KNOB=VALUE`` as ``redline tune --space`` spells a value, or ``mb=N`` for the micro-batch
(``mb=8+precision=bf16`` is a combination a tune's coordinate descent reaches one change at a time). On a
shared machine one run of a config can be 20-40% slower than its others; a tune's choice is right when it
matches what many interleaved rounds here show, not what one of its own runs showed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

# the targets and their trials as the grid benchmark runs them (this script's folder is on the path)
from tune_vs_grid import TARGETS, add_trial_arguments, parse_trial_arguments, side_by_side

from redline.errors import BadInput
from redline.tune.search import spread
from redline.tune.space import Candidate, Machine, default_plan, restrict, trial_plan
from redline.tune.trial import Setup


def candidate(default: Candidate, spec: str) -> Candidate:
    """``default`` with the changes ``spec`` names (``mb=N`` or ``KNOB=VALUE``, joined by ``+``)."""
    config = default
    for change in spec.split("+"):
        knob, _, value = change.partition("=")
        if knob == "mb":
            if not value.isdigit() or int(value) < 1:
                raise BadInput(f"mb takes a whole number from 1; not {value!r}")
            config = config.with_micro_batch(int(value))
        else:
            (parsed,) = restrict({}, [change])[knob][1:]
            config = config.with_value(knob, parsed)
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="hf-gpt2", choices=sorted(TARGETS))
    parser.add_argument("--configs", default="precision=bf16,num_workers=1,mb=8")
    add_trial_arguments(parser, trial_steps=12, rounds=4)
    args = parse_trial_arguments(parser)
    script, script_args, _ = TARGETS[args.target]
    batch = int(script_args[script_args.index("--batch") + 1])
    machine = Machine.here(1)
    base = default_plan(machine, batch)
    default = Candidate(batch)
    try:
        configs = {"default": default} | {spec: candidate(default, spec) for spec in args.configs.split(",")}
    except BadInput as exc:
        parser.error(str(exc))
    setup = Setup(script=str(script), args=script_args, warmup_steps=args.warmup, steps=args.trial_steps)
    plans = {name: trial_plan(config, base=base, per_rank_batch=batch, ranks=1) for name, config in configs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        speeds = side_by_side(setup, plans, Path(tmp), args.rounds)
    reference = statistics.median(speeds["default"])
    rows = [
        {
            "config": name,
            "median_samples_per_s": statistics.median(runs),
            "over_default": statistics.median(runs) / reference if reference else None,
            "spread": spread(runs),
            "runs": runs,
        }
        for name, runs in speeds.items()
    ]
    if args.json:
        print(json.dumps({"target": args.target, "rounds": args.rounds, "rows": rows}, indent=2))
        return
    for row in rows:
        runs = ", ".join(f"{speed:.0f}" for speed in row["runs"])
        print(
            f"{args.target:8} {row['config']:30} {row['median_samples_per_s']:8.1f} samples/s  "
            f"{row['over_default']:.2f}x the default  spread {row['spread']:.0%}  ({runs})"
        )


if __name__ == "__main__":
    main()
