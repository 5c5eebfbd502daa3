"""`redline run`: launch a training script that calls `redline.prepare()`, alone or through torchrun.

Everything after the script is the script's own arguments. The plan goes to the script in REDLINE_PLAN and is
checked first: it must load, and its world size (data x tensor x pipeline) must equal the processes launched.
The runtime options (--metrics, --checkpoint-dir, --accumulation ...: ``runtime.config.SETTINGS``) go to the
script's prepare() in REDLINE_RUNTIME, over the plan's ``runtime:`` section and prepare()'s keywords. A plan
made for another device or another model is refused by prepare() in one line (exit 2) unless --plan-anyway. One
process on one node runs as `python SCRIPT ARGS` would; more, several nodes or --max-restarts go through
torchrun, which restarts the worker group when a worker dies (elastic).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from redline.cli import params, ui
from redline.env import REDLINE_PLAN

if TYPE_CHECKING:
    from redline.runtime.config import RunConfig
    from redline.runtime.launch import Launch


@params.with_runtime_options
def run(
    ctx: typer.Context,
    script: str = typer.Argument(
        ..., metavar="SCRIPT [ARGS]...", help="The training script, then its own arguments.", show_default=False
    ),
    plan: Path | None = typer.Option(
        None,
        "--plan",
        envvar=REDLINE_PLAN,  # the variable the script's prepare() reads
        help="The plan file (`redline plan -o plan.yaml`); without one prepare() uses its defaults.",
    ),
    nproc_per_node: str = typer.Option(
        "auto",
        "--nproc-per-node",
        help="Processes per node, or auto: one per CUDA GPU; without GPUs the plan's count; else 1.",
    ),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes: N, or MIN:MAX for an elastic range."),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node (several nodes)."
    ),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id", help="Rendezvous id, the same on every node."),
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="Restart the workers this many times when one fails (torchrun, elastic)."
    ),
    plan_anyway: bool = typer.Option(False, "--plan-anyway", help="Run a plan made for another device or model."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and environment, run nothing."),
    json_out: bool = typer.Option(False, "--json", help="With --dry-run: the launch as JSON."),
    runtime: dict | None = None,  # the runtime options given (params.with_runtime_options)
) -> None:
    """Run a training script with a plan: one process as plain python, or N per node through torchrun."""
    from redline.capability import require_torch
    from redline.errors import BadInput
    from redline.runtime import launch as launcher

    if json_out and not dry_run:
        raise BadInput("--json describes the launch and goes with --dry-run; a run's output is the script's")
    nodes = launcher.parse_nodes(nnodes)
    runtime = runtime or {}
    if plan_anyway:  # for the script's prepare(), which sees the model and the device the plan must fit
        if plan is None:
            raise BadInput("--plan-anyway goes with --plan: without a plan there is nothing to force")
        runtime = runtime | {"plan_anyway": True}
    config = _checked_plan(plan, runtime)
    strategy = config.strategy if config is not None else None
    plan_path = str(plan.resolve()) if plan is not None else None
    cuda_gpus = functools.cache(launcher.visible_cuda_gpus)  # a child that imports torch: counted once at most
    nproc, why = launcher.resolve_nproc_per_node(nproc_per_node, nodes, strategy, cuda_gpus)
    if strategy is not None:
        launcher.check_world_size(strategy, nproc, nodes, str(plan))
    spec = launcher.build_launch(
        script,
        list(ctx.args),
        nproc_per_node=nproc,
        nodes=nodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        plan_path=plan_path,
        runtime=runtime,
    )
    if spec.torchrun:
        require_torch("a launch of more than one process (torchrun)")
    if dry_run:
        if json_out:
            ui.print_json(spec.to_dict() | {"nproc_per_node_from": why})
        else:
            ui.console.print(spec.shell_line(), highlight=False, soft_wrap=True)
        return
    _execute(spec, why, config, nodes.elastic, cuda_gpus)


def _execute(spec: Launch, why: str, config: RunConfig | None, elastic: bool, cuda_gpus: Callable[[], int]) -> None:
    """Launch ``spec`` after the checks that need this machine (a plan made for a GPU where none is visible is
    refused before any rank starts), saying what runs; the script's exit code is the command's."""
    from redline.runtime import launch as launcher
    from redline.runtime.plan_fit import check_launch_device

    strategy = config.strategy if config is not None else None
    if config is not None and config.plan.device and not config.plan.anyway:
        check_launch_device(config, cuda_gpus())
    ui.warn(_describe(spec, why, strategy.label() if strategy else None))
    if elastic and strategy is not None:
        ui.warn(
            f"--nnodes {spec.nodes} is elastic: the plan is laid out for all {spec.nodes.max} nodes "
            f"({spec.world_size} processes); with fewer, the world is smaller than planned and only data "
            "parallelism can shrink"
        )
    outcome = launcher.execute(spec)
    if outcome.signal is not None:
        ui.error(f"interrupted ({outcome.signal}): the script was stopped")
    if outcome.exit_code:
        raise typer.Exit(outcome.exit_code)


def _checked_plan(plan: Path | None, runtime: dict) -> RunConfig | None:
    """The plan's settings, with the runtime options over its ``runtime:`` section, checked before any rank
    starts (each would fail the same way): None without a plan. A checkpoint directory to resume from is
    checked as the resume will check it (``files.check_trusted``), so a refusal is one line here, not a
    traceback of the script's."""
    from redline.files import check_trusted
    from redline.runtime.config import check_runnable, check_settings, from_plan_file

    check_settings(runtime)
    config = None
    if plan is not None:
        from redline.plan.planfile import load_plan

        check_runnable(load_plan(plan).strategy, str(plan))
        config = from_plan_file(plan).with_settings(runtime)
    checkpoints = config.checkpoint.dir if config is not None else runtime.get("checkpoint_dir")
    if checkpoints:  # a refusal only: the resume checks the folder again, and loads from what it checked
        check_trusted(checkpoints, "checkpoint directory")
    return config


def _describe(spec: Launch, why: str, plan_label: str | None) -> str:
    """One line before the launch: what runs, as how many processes, with which plan."""
    count = f"{spec.world_size} process{'es' if spec.world_size != 1 else ''}"
    if spec.torchrun:
        how = f"torchrun, {spec.nproc_per_node} per node ({why}) x {spec.nodes} node(s)"
        if spec.max_restarts:
            how += f", up to {spec.max_restarts} restart(s)"
    else:
        how = "plain python"
    plan = f"plan {spec.plan_path} ({plan_label})" if spec.plan_path else "no plan (prepare() uses its defaults)"
    return f"running {spec.script} as {count} ({how}) with {plan}"
