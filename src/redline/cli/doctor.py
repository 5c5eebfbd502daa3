"""`redline doctor`: audit this server (or a saved snapshot) and explain what costs throughput."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from redline.cli import ui
from redline.cli.probe import check_data_paths
from redline.report.output import write_output

if TYPE_CHECKING:
    from redline.bench.model import BenchRun
    from redline.hw.snapshot import Snapshot


def doctor(
    from_file: Path | None = typer.Option(
        None, "--from", help="Audit a snapshot saved by `redline probe --json` ('-' reads stdin)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print findings and summary as JSON."),
    html: Path | None = typer.Option(None, "--html", help="Write a self-contained HTML report to this file."),
    data: list[str] = typer.Option([], "--data", help="Dataset path to check (filesystem, disk); repeatable."),
    list_rules: bool = typer.Option(False, "--list-rules", help="List every rule and exit."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when any finding is a fail."),
    bench: bool = typer.Option(False, "--bench", help="Add findings from this machine's saved `bench --save` run."),
    bench_file: Path | None = typer.Option(None, "--bench-file", help="Add findings from this saved bench run."),
) -> None:
    """Audit this server: findings grouped by area, worst first, each with evidence, cost and fix."""
    from redline.doctor.engine import all_rules, run_rules
    from redline.errors import BadInput
    from redline.report.summary import server_summary

    if list_rules:
        _print_rules(all_rules(), json_out)
        return
    if from_file is not None:
        if data:
            raise BadInput("--data applies to a live probe; probe the remote server with --data instead")
        from redline.hw.snapshot import load_snapshot

        snapshot = load_snapshot(from_file)
    else:
        from redline.hw.probe import CPU_SAMPLE_S, take_snapshot

        snapshot = take_snapshot(data_paths=check_data_paths(data), cpu_sample_s=CPU_SAMPLE_S)

    report = run_rules(snapshot, bench=_bench_run(snapshot, bench, bench_file))
    if html is not None:
        from redline.report.html import GENERATOR, render_html

        write_output(html, render_html(report, snapshot), marker=GENERATOR, protect=from_file)
    if json_out:
        ui.print_json(
            {
                "summary": server_summary(snapshot),
                "counts": report.counts(),
                "rules_checked": report.rules_checked,
                "findings": [f.to_dict() for f in report.sorted()],
                "notes": report.rule_errors + snapshot.probe_errors,
            }
        )
    else:
        from redline.report.terminal import render

        render(report, snapshot, ui.console)
        if html is not None:
            ui.console.print(ui.dim(f"HTML report written to {html}"))
    if strict and report.counts()["fail"]:
        raise typer.Exit(1)


def _bench_run(snapshot: Snapshot, latest: bool, path: Path | None) -> BenchRun | None:
    """The bench run to judge: a named file, or the newest saved for the machine the snapshot describes."""
    if path is None and not latest:
        return None
    from redline.bench import store
    from redline.errors import BadInput

    if path is not None:
        named = store.load(path)
        ui.warn(f"judging the bench results in {path} (taken {named.taken_at})")
        return named
    fingerprint, _ = store.fingerprint(snapshot)
    run = store.latest(fingerprint)
    if run is None:
        raise BadInput(
            f"no saved bench results for this machine (fingerprint {fingerprint}); "
            "run `redline bench --save` first, or pass --bench-file"
        )
    paths = store.saved_runs(fingerprint)
    n = len(paths) - 1
    older = f", with the newest figure of each kind from {n} older run{'s' * (n > 1)} beside it" if n else ""
    ui.warn(f"judging the bench results in {paths[-1]} (taken {run.taken_at}){older}")
    return run


def _print_rules(rules: list, json_out: bool) -> None:
    """Every rule by area (the report's section headings), its id and what it checks: an id names its area
    already, so the table spends its width on what the rule checks, and fits an 80-column terminal."""
    if json_out:
        ui.print_json([r.to_dict() for r in rules])
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{len(rules)} doctor rules", title_justify="left", box=None, pad_edge=False)
    table.add_column("rule", style="cyan", no_wrap=True)
    table.add_column("checks")
    area = None
    for r in rules:  # in area order
        if r.area != area:
            area = r.area
            table.add_row(Text(r.area.heading, style="bold"), "")
        table.add_row(r.id, r.summary)
    ui.print_table(table)
