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
from redline.report.wrap import Values, prose

EVIDENCE_CHARS = 240  # the full evidence is in --json and --html
STYLE = {Severity.FAIL: "bold white on red", Severity.WARN: "bold black on yellow", Severity.INFO: "bold white on blue"}


def _summary_panel(snapshot: Snapshot) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for label, value in server_summary(snapshot).items():
        table.add_row(label, Text(value))
    return Panel(table, title="redline doctor", title_align="left", border_style="cyan")


def _compact(evidence: dict) -> list[str]:
    """The evidence as compact JSON cut into its items (``"key": value,``), so that lines break between
    items; past ``EVIDENCE_CHARS`` the items left out are one "..." (--json and --html have them all)."""
    text = json.dumps(evidence, default=str, separators=(", ", ": "))
    items = [item + "," for item in text.split(", ")]
    items[-1] = items[-1].removesuffix(",")
    kept: list[str] = []
    for item in items:
        if sum(len(k) + 1 for k in kept) + len(item) > EVIDENCE_CHARS:
            return [*kept, "..."]
        kept.append(item)
    return kept


def _sentence(text: str, style: str = "") -> Values:
    return Values([Text(word, style=style) for word in prose(text)], separator=" ", indent=0)


def render_finding(f: Finding) -> Group:
    """A finding's title, then what it costs, how to fix it, what was seen: each line wrapped between words, a
    number kept with its unit, a piece of evidence kept whole."""
    title = [Text(f" {f.severity.value.upper()} ", style=STYLE[f.severity])]
    title += [Text(word, style="bold") for word in prose(f.title)]
    if f.subject:
        title.append(Text(f" [{f.subject}]", style="dim"))
    head = Values(title, separator=" ", indent=7)
    body = Table.grid(padding=(0, 1))
    body.add_column(style="dim", width=7, justify="right")
    body.add_column()
    body.add_row("cost", _sentence(f.cost))
    body.add_row("fix", _sentence(f.fix))
    if f.evidence:
        body.add_row("seen", Values(_compact(f.evidence), separator=" ", indent=0))
    if f.command:
        # whole on its line where it fits, else folded: a command cut with an ellipsis cannot be copied
        body.add_row("see", Text(f"$ {f.command}", style="cyan", overflow="fold"))
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
