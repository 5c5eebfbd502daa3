"""The doctor report as one self-contained HTML page (inline CSS, no scripts, no external assets).

A user on a remote server writes it with ``redline doctor --html report.html``, copies the one file
home and opens it in a browser.
"""

from __future__ import annotations

import json
from html import escape

from redline import __version__
from redline.doctor.engine import DoctorReport
from redline.doctor.model import Finding
from redline.hw.snapshot import Snapshot
from redline.report.summary import server_summary

# written into every page, so a later run knows the file is a redline report it may replace
GENERATOR = "redline doctor"

CSS = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:70rem;
     padding:0 1rem;color:#1d2330;background:#fafbfc}
h1{font-size:1.6rem;margin:0 0 .3rem} h2{font-size:1.15rem;margin:2rem 0 .6rem;border-bottom:1px solid #d8dde6}
table.summary td{padding:.15rem 1rem .15rem 0;vertical-align:top} table.summary td:first-child{font-weight:600}
.counts span{display:inline-block;margin-right:.8rem;font-weight:600}
.finding{background:#fff;border:1px solid #d8dde6;border-left:6px solid #999;border-radius:6px;
         padding:.6rem .9rem;margin:.6rem 0}
.finding.fail{border-left-color:#c62828} .finding.warn{border-left-color:#e0a800}
.finding.info{border-left-color:#1e63c4}
.sev{font-size:.75rem;font-weight:700;color:#fff;border-radius:3px;padding:.05rem .4rem;margin-right:.5rem}
.sev.fail{background:#c62828} .sev.warn{background:#e0a800;color:#111} .sev.info{background:#1e63c4}
.title{font-weight:600} .subject{color:#5a6475;margin-left:.4rem}
dl{display:grid;grid-template-columns:4.5rem 1fr;gap:.2rem .6rem;margin:.5rem 0 0}
dt{color:#5a6475} dd{margin:0} code,pre{font:13px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre{background:#f1f3f6;padding:.4rem .6rem;border-radius:4px;overflow-x:auto;margin:0}
.rule{color:#8a93a3;font-size:.8rem} .notes li{color:#8a5a00}
footer{margin-top:2.5rem;color:#8a93a3;font-size:.85rem}
"""


def _finding(f: Finding) -> str:
    sev = f.severity.value
    subject = f'<span class="subject">[{escape(f.subject)}]</span>' if f.subject else ""
    command = f"<dt>see</dt><dd><pre>$ {escape(f.command)}</pre></dd>" if f.command else ""
    evidence = json.dumps(f.evidence, indent=1, default=str)
    return (
        f'<div class="finding {sev}"><span class="sev {sev}">{sev.upper()}</span>'
        f'<span class="title">{escape(f.title)}</span>{subject}'
        f"<dl><dt>cost</dt><dd>{escape(f.cost)}</dd><dt>fix</dt><dd>{escape(f.fix)}</dd>"
        f"<dt>evidence</dt><dd><pre>{escape(evidence)}</pre></dd>{command}</dl>"
        f'<div class="rule">rule {escape(f.rule)}</div></div>'
    )


def render_html(report: DoctorReport, snapshot: Snapshot) -> str:
    summary = "".join(
        f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in server_summary(snapshot).items()
    )
    counts = report.counts()
    body = []
    for area, findings in report.grouped():
        body.append(f"<h2>{escape(area.heading)}</h2>")
        body.extend(_finding(f) for f in findings)
    if not report.findings:
        body.append("<p>No findings: every rule passed.</p>")
    notes = report.rule_errors + snapshot.probe_errors
    notes_html = (
        '<h2>Notes</h2><ul class="notes">' + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>" if notes else ""
    )
    host = escape(snapshot.host.hostname or "server")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>redline doctor: {host}</title><style>{CSS}</style></head>
<body>
<h1>redline doctor: {host}</h1>
<p class="counts"><span style="color:#c62828">{counts["fail"]} fail</span>
<span style="color:#a07800">{counts["warn"]} warn</span><span style="color:#1e63c4">{counts["info"]} info</span>
from {report.rules_checked} rules</p>
<table class="summary">{summary}</table>
{"".join(body)}
{notes_html}
<footer>redline {escape(__version__)}; snapshot schema {snapshot.schema_version}</footer>
</body></html>
"""
