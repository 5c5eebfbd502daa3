"""The doctor report for a terminal: server summary, then findings grouped by area, worst first."""

from __future__ import annotations

import json

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from redline.doctor.engine import DoctorReport
from redline.doctor.model import Finding, Severity
from redline.hw.snapshot import Snapshot
from redline.report.summary import server_summary

EVIDENCE_CHARS = 240  # the full evidence is in --json and --html
STYLE = {Severity.FAIL: "bold white on red", Severity.WARN: "bold black on yellow", Severity.INFO: "bold white on blue"}


def _summary_panel(snapshot: Snapshot) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for label, value in server_summary(snapshot).items():
        table.add_row(label, Text(value))
    return Panel(table, title="redline doctor", title_align="left", border_style="cyan")


def _compact(evidence: dict) -> str:
    text = json.dumps(evidence, default=str, separators=(", ", ": "))
    return text if len(text) <= EVIDENCE_CHARS else text[: EVIDENCE_CHARS - 3] + "..."


def render_finding(f: Finding) -> Group:
    head = Text.assemble((f" {f.severity.value.upper()} ", STYLE[f.severity]), " ", (f.title, "bold"))
    if f.subject:
        head.append(f"  [{f.subject}]", style="dim")
    body = Table.grid(padding=(0, 1))
    body.add_column(style="dim", width=7, justify="right")
    body.add_column(overflow="fold")
    body.add_row("cost", Text(f.cost))
    body.add_row("fix", Text(f.fix))
    if f.evidence:
        body.add_row("seen", Text(_compact(f.evidence)))
    if f.command:
        body.add_row("see", Text(f"$ {f.command}", style="cyan"))
    body.add_row("rule", Text(f.rule, style="dim"))
    return Group(head, body)


def render(report: DoctorReport, snapshot: Snapshot, console: Console) -> None:
    console.print(_summary_panel(snapshot))
    for area, findings in report.grouped():
        console.rule(Text(area.heading, style="bold"), align="left")
        for f in findings:
            console.print(render_finding(f))
    for error in report.rule_errors + snapshot.probe_errors:
        console.print(Text(f"note: {error}", style="yellow"))
    counts = report.counts()
    console.print(
        Text.assemble(
            "\n",
            (f"{counts['fail']} fail", "bold red"),
            ", ",
            (f"{counts['warn']} warn", "bold yellow"),
            ", ",
            (f"{counts['info']} info", "bold blue"),
            f" from {report.rules_checked} rules",
            " (redline doctor --list-rules shows them all)",
        )
    )
