"""`redline tune`: run the user's training script with candidate settings, measure each, keep the fastest that
trains as the baseline does, and write it as a plan file for `redline run --plan`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from redline.cli import ui

if TYPE_CHECKING:
    from rich.table import Table

    from redline.tune.predict import Predictor
    from redline.tune.search import Outcome, Trial
    from redline.tune.space import Candidate


def tune(
    ctx: typer.Context,
    script: str = typer.Argument(
        ..., metavar="SCRIPT [ARGS]...", help="The training script, then its own arguments.", show_default=False
    ),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Processes each trial runs (one per GPU)."),
    plan: Path | None = typer.Option(None, "--plan", help="A base plan file: the baseline and what trials change."),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="The model the script trains, as `redline plan -m` takes it: the planner then predicts each candidate "
        "(default: the model the --plan file was made for).",
    ),
    seq_len: int | None = typer.Option(None, "--seq-len", help="With --model: its training sequence length."),
    input_shape: str | None = typer.Option(None, "--input-shape", help="With --model: a factory's sample, 3,32,32."),
    budget: str | None = typer.Option(None, "--budget", help="Time the trials may take in all: 90s, 20m, 1h."),
    max_trials: int | None = typer.Option(None, "--max-trials", help="Trials to run at most."),
    trial_steps: int = typer.Option(8, "--trial-steps", help="Optimizer steps each trial measures."),
    warmup: int = typer.Option(2, "--warmup", help="Optimizer steps each trial runs first, unmeasured."),
    steps: int | None = typer.Option(
        None, "--steps", help="Optimizer steps of the real run: a trial's startup (compile) is spread over them."
    ),
    trial_timeout: str = typer.Option("10m", "--trial-timeout", help="A trial still running after this is stopped."),
    space: list[str] = typer.Option(
        [], "--space", help="KNOB=V1,V2: only these values of a knob (KNOB=: leave it out). Repeatable."
    ),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write the winner's plan file here."),
    html: Path | None = typer.Option(None, "--html", help="Write an HTML report (a plot of every trial) here."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="The journals (default $REDLINE_HOME/tune)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the knobs and trials, run nothing."),
    json_output: bool = typer.Option(False, "--json", help="The trials and the winner as JSON."),
) -> None:
    """Find the fastest way to run a training script on this machine, by running it."""
    from redline.capability import require_torch

    require_torch("redline tune runs the script")
    from redline.tune.space import Machine, default_space, restrict
    from redline.tune.trial import Setup

    seconds, timeout_s = _checked(script, nproc_per_node, trial_steps, warmup, max_trials, steps, budget, trial_timeout)
    _check_targets(output, html, cache_dir)
    base = _base_plan(plan, nproc_per_node)
    machine = Machine.here(nproc_per_node)
    knobs = restrict(default_space(machine), space)
    planner = _planner(model, seq_len, input_shape, base, nproc_per_node, quiet=json_output)
    setup = Setup(
        script=str(Path(script).resolve()),
        args=tuple(ctx.args),
        nproc_per_node=nproc_per_node,
        warmup_steps=warmup,
        steps=trial_steps,
        timeout_s=timeout_s,
        run_steps=steps,
    )
    if dry_run:
        _dry_run(knobs, base, setup, planner, json_output)
        return
    outcome, journal = _search(setup, machine, knobs, base, planner, cache_dir, seconds, max_trials, json_output)
    if output is not None and outcome.plan is not None:
        _write_plan(output, outcome.plan)
    if html is not None:
        from redline.report.output import write_output
        from redline.tune.report import GENERATOR, html_report

        write_output(html, html_report(outcome, Path(script).name), marker=GENERATOR)
    if json_output:
        ui.print_json(_to_json(outcome, journal))
        return
    _print(outcome, journal, output)


def _checked(
    script: str,
    nproc_per_node: int,
    trial_steps: int,
    warmup: int,
    max_trials: int | None,
    steps: int | None,
    budget: str | None,
    trial_timeout: str,
) -> tuple[float | None, float]:
    """The options checked, each bad one a line: the budget's and a trial's limit in seconds."""
    from redline.errors import BadInput
    from redline.files import refuse_non_regular
    from redline.units import parse_duration

    refuse_non_regular(script, "script")
    if not Path(script).is_file():
        raise BadInput(f"{script}: no such script")
    for name, value, lowest in (("--nproc-per-node", nproc_per_node, 1), ("--trial-steps", trial_steps, 1)):
        if value < lowest:
            raise BadInput(f"{name} must be at least {lowest}, not {value}")
    if warmup < 0 or (max_trials is not None and max_trials < 1) or (steps is not None and steps < 1):
        raise BadInput("--warmup must be 0 or more, --max-trials and --steps 1 or more")
    from redline.runtime.launch import check_nproc_per_node, visible_cuda_gpus

    check_nproc_per_node(nproc_per_node, visible_cuda_gpus)  # each trial launches that many
    try:
        return (parse_duration(budget) if budget is not None else None), parse_duration(trial_timeout)
    except ValueError as exc:
        raise BadInput(f"--budget/--trial-timeout: {exc}") from None


def _check_targets(output: Path | None, html: Path | None, cache_dir: Path | None) -> None:
    """The files the tune will write, refused now rather than after the trials."""
    from redline.plan.planfile import PLAN_MARKER
    from redline.report.output import check_target
    from redline.tune.report import GENERATOR

    for target, marker in ((output, PLAN_MARKER), (html, GENERATOR)):
        if target is not None:
            check_target(target, marker=marker)
    if cache_dir is not None:
        from redline.files import refuse_non_folder

        refuse_non_folder(cache_dir, "--cache-dir")


def _planner(
    model: str | None,
    seq_len: int | None,
    input_shape: str | None,
    base: dict[str, Any] | None,
    ranks: int,
    quiet: bool,
) -> Predictor | None:
    """The planner for the model given (``--model``, else the one the base plan records it was made for) on
    this machine; None without a model, or (said) where the planner cannot predict this machine."""
    from redline.cli.params import parse_input_shape
    from redline.cli.plan import model_load
    from redline.errors import BadInput
    from redline.tune.predict import load_profile, on_this_machine

    if model is None and (seq_len is not None or input_shape is not None):
        raise BadInput("--seq-len and --input-shape go with --model")
    load = model_load(model, None, seq_len, parse_input_shape(input_shape), False) if model is not None else None
    load = load or ((base or {}).get("model") or {}).get("load")
    if not load:
        return None
    profile = load_profile(load)
    try:
        return on_this_machine(profile, ranks)
    except BadInput as exc:
        if not quiet:
            ui.warn(f"the planner does not rank the trials: {exc}")
        return None


def _search(
    setup: Any,
    machine: Any,
    knobs: dict[str, list[Any]],
    base: dict[str, Any] | None,
    planner: Predictor | None,
    cache_dir: Path | None,
    seconds: float | None,
    max_trials: int | None,
    quiet: bool,
) -> tuple[Outcome, Path]:
    """The tune itself, its journal opened (and said when it goes on from an earlier one), a progress bar
    counting the trials: the outcome and the journal's path."""
    from redline.tune.journal import Journal
    from redline.tune.search import Budget, Tuner

    journal = Journal.open(setup, base, cache_dir)
    if journal.resumed and not quiet:
        ui.warn(f"going on from {journal.path}: {len(journal.results)} trial(s) there are not run again")
    with ui.progress_bar(enabled=not quiet) as progress:
        done: list[Trial] = []
        running = ["trials"]  # the trial being run, named as it starts: the count goes on it

        def about() -> int:
            return max(len(done) + 1, _expected(knobs) + 4)

        def starting(label: str, candidate: Candidate | None) -> None:
            what = "baseline" if candidate is None else f"{label}, {candidate.key()}"
            running[0] = f"trial {len(done) + 1}: {what}"
            progress(running[0], len(done), about())

        def advance(trial: Trial) -> None:
            done.append(trial)
            progress(running[0], len(done), about())

        tuner = Tuner(
            setup,
            machine,
            knobs,
            journal,
            journal.path.with_suffix(""),
            base_plan=base,
            budget=Budget(seconds=seconds, trials=max_trials),
            device_memory=_device_memory(),
            progress=advance,
            starting=starting,
            planner=planner,
        )
        return tuner.tune(), journal.path


def _base_plan(plan: Path | None, ranks: int) -> dict[str, Any] | None:
    """The base plan file as a mapping, checked as `redline run` checks it."""
    if plan is None:
        return None
    import yaml

    from redline.runtime.config import from_plan_file

    config = from_plan_file(plan)  # BadInput for anything it cannot run
    if config.strategy.gpus != ranks:
        from redline.errors import BadInput

        raise BadInput(
            f"{plan} is laid out for {config.strategy.gpus} processes: tune with --nproc-per-node "
            f"{config.strategy.gpus}"
        )
    from redline.files import read_user_file

    return yaml.safe_load(read_user_file(plan, "plan file"))


def _device_memory() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _expected(knobs: dict[str, list[Any]]) -> int:
    """About how many trials the search runs: each knob's other values, a few micro-batches, the repeats (of the
    default, of a change before it is kept, of the leaders, and the pick's and the default's side by side)."""
    return sum(len(values) - 1 for values in knobs.values()) + 10


def _dry_run(
    knobs: dict[str, list[Any]], base: dict[str, Any] | None, setup: Any, planner: Predictor | None, json_output: bool
) -> None:
    from redline.units import fmt_duration

    rows = []
    if planner is not None and base is not None:
        from redline.tune.predict import dry_run_rows

        rows = dry_run_rows(planner, base, knobs, setup.nproc_per_node)
    step_s = rows[0][1].step_s if rows else ((base or {}).get("predicted") or {}).get("step_time_s", {}).get("total")
    trial_s = step_s * (setup.warmup_steps + setup.steps) if step_s else None
    values = {knob: ["default" if v is None else v for v in vs] for knob, vs in knobs.items()}
    if json_output:
        predicted = [
            {"config": key, "step_s": p.step_s, "samples_per_s": p.samples_per_s, "peak_bytes": p.allocated_bytes}
            for key, p in rows
        ]
        ui.print_json(
            {"knobs": values, "trials_about": _expected(knobs), "predicted_trial_s": trial_s, "predicted": predicted}
        )
        return
    ui.print_table(knobs_table(values))
    ui.console.print("default: as the script and the runtime have it")
    if rows and planner is not None:  # rows come from the planner
        ui.print_table(prediction_table(planner.model, rows))
        ui.console.print("compile, workers, threads and DDP's knobs are not in the planner: predicted as the base")
    elif planner is None:
        ui.console.print("give --model (or --plan with a plan `redline plan -m` wrote) for the planner's predictions")
    else:
        ui.console.print("the planner predicts the trials from a base plan: give --plan")
    each = f", their steps about {fmt_duration(trial_s)} each by the planner (launch not counted)" if trial_s else ""
    ui.console.print(
        f"about {_expected(knobs)} trials of {setup.warmup_steps} + {setup.steps} steps{each}; nothing was run"
    )


def knobs_table(values: dict[str, list[Any]]) -> Table:
    """What the trials would change: each knob and the values tried (the micro-batch's by search)."""
    from rich.table import Table

    table = Table(title="redline tune: what the trials would change", title_justify="left")
    table.add_column("knob", no_wrap=True)
    table.add_column("values")
    table.add_row("micro_batch", "the largest that fits (binary search over the per-rank batch's divisors), and half")
    for knob, vs in values.items():
        table.add_row(knob, ", ".join(str(v) for v in vs))
    return table


def prediction_table(model: str, rows: list[tuple[str, Any]]) -> Table:
    """The planner's figure for each candidate ``rows`` holds (config, prediction), the first the base plan's."""
    from rich.table import Table

    from redline.units import fmt_bytes

    table = Table(title=f"the planner's prediction for {model} (before any trial)", title_justify="left")
    table.add_column("config")
    for column in ("step ms", "samples/s", "x base", "peak"):
        table.add_column(column, justify="right", no_wrap=True)
    for key, p in rows:
        speedup = p.samples_per_s / rows[0][1].samples_per_s
        table.add_row(
            key, f"{p.step_s * 1e3:,.1f}", f"{p.samples_per_s:,.1f}", f"{speedup:.2f}", fmt_bytes(p.allocated_bytes)
        )
    return table


def trials_table(outcome: Outcome) -> Table:
    """Every trial the tune ran (or took from its journal), in order, as the HTML report lists them, less the
    columns no trial fills (planned/s without the planner): a column of nothing costs a narrow terminal the room
    its config names need. A figure is never wrapped."""
    from rich.table import Table

    from redline.tune.report import COLUMNS, NUMERIC, trial_cells

    rows = [trial_cells(trial, outcome) for trial in outcome.trials]
    shown = [i for i in range(len(COLUMNS)) if any(row[i] for row in rows)]
    table = Table(title="redline tune: trials", title_justify="left")
    for i in shown:
        figure = COLUMNS[i] in NUMERIC and COLUMNS[i] != "median of runs"  # that one is a sentence
        table.add_column(COLUMNS[i], justify="right" if COLUMNS[i] in NUMERIC else "left", no_wrap=figure)
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


def _write_plan(path: Path, plan: dict[str, Any]) -> None:
    """The winner's plan file, as `redline plan -o` writes one (never over a file redline did not write)."""
    import yaml

    from redline.plan.planfile import PLAN_MARKER
    from redline.report.output import write_output

    write_output(path, yaml.safe_dump(plan, sort_keys=False, width=120), marker=PLAN_MARKER)


def _print(outcome: Outcome, journal: Path, output: Path | None) -> None:
    from redline.tune.report import noise_line, planner_line

    ui.print_table(trials_table(outcome))
    if outcome.winner is None:
        ui.console.print("no candidate trained as the baseline does: keep running as you do")
        return
    ui.console.print(
        f"winner: {outcome.winner.key()}: {outcome.winner_speed:,.1f} samples/s (median of its runs), "
        f"{outcome.speedup:.2f}x the baseline's median; parity: {outcome.parity}"
    )
    if outcome.spread is not None:
        ui.console.print(noise_line(outcome))
    if outcome.predicted_default is not None:
        ui.console.print(planner_line(outcome))
    if outcome.stopped:
        ui.console.print(f"stopped early: {outcome.stopped}")
    if output is not None:
        ui.console.print(f"the winner's plan: {output} (`redline run --plan {output} ...`); journal {journal}")
    else:
        ui.console.print(f"give -o FILE to write the winner's plan; journal {journal}")


def _to_json(outcome: Outcome, journal: Path) -> dict[str, Any]:
    """The trials, each config's runs (their median and spread: what the search compared) and the winner."""
    import statistics

    from redline.tune.search import spread

    return {
        "baseline": outcome.baseline.to_dict(),
        "trials": [
            {
                "for": t.label,
                "config": None if t.candidate is None else t.candidate.to_dict(),
                "cached": t.cached,
                "predicted_samples_per_s": t.predicted.samples_per_s if t.predicted else None,
                **t.result.to_dict(),
            }
            for t in outcome.trials
        ],
        "winner": None if outcome.winner is None else outcome.winner.to_dict(),
        "winner_samples_per_s": outcome.winner_speed,
        "speedup": outcome.speedup,
        "spread": outcome.spread,
        "noise": outcome.noise,
        "configs": [
            {"config": key, "runs": list(runs), "median": statistics.median(runs), "spread": spread(runs)}
            for key, runs in outcome.scores.items()
            if runs
        ],
        "parity": str(outcome.parity),
        "stopped": outcome.stopped,
        "predicted_samples_per_s": {"default": outcome.predicted_default, "winner": outcome.predicted_winner},
        "plan": outcome.plan,
        "journal": str(journal),
    }
