"""What `redline infer` shows: the terminal tables (rich), the verdict line, and one self-contained HTML page
(inline CSS, the plot as a base64 PNG drawn with matplotlib's object API, as the tune's report draws)."""

from __future__ import annotations

import base64
import io
from html import escape
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.table import Table

from redline import __version__
from redline.infer.generate import GenerationRow
from redline.infer.measure import Row, Settings, speedups
from redline.report.html import CSS
from redline.units import fmt_bytes

GENERATOR = "redline infer report"
COLUMNS = (
    "backend",
    "batch",
    "status",
    "cold s",
    "p50 ms",
    "p99 ms",
    "samples/s",
    "x eager",
    "memory",
    "rel err",
    "top-1",
)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} ms" if value < 100 else f"{value:,.0f} ms"


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def cells(row: Row, ratio: float | None) -> list[str]:
    """A row's columns as text; ``ratio`` is its p50 over eager's (below 1: faster). Why a row did not run is
    in ``notes``, not here."""
    status = row.status + (" (over SLO)" if row.meets_slo is False else "")
    if row.status in ("absent", "failed"):
        return [row.backend, str(row.batch), status, *[""] * (len(COLUMNS) - 3)]
    parity = row.parity
    return [
        row.backend,
        str(row.batch),
        status,
        "" if row.cold_s is None else f"{row.cold_s:.1f}",
        _number(row.p50_ms),
        _number(row.p99_ms),
        "" if row.samples_per_s is None else f"{row.samples_per_s:,.1f}",
        "" if ratio is None else f"{1 / ratio:.2f}x",
        "" if row.peak_memory_bytes is None else fmt_bytes(row.peak_memory_bytes),
        "" if parity is None else f"{parity.max_rel:.1e}",
        "" if parity is None or parity.top1 is None else f"{parity.top1:.0%}",
    ]


def notes(rows: list[Row]) -> list[str]:
    """Why each backend that did not run (or did not match) did not, once per backend and reason."""
    said = dict.fromkeys(f"{r.backend}: {r.status}: {r.note}" for r in rows if r.status != "ok" and r.note)
    return list(said)


def rows_table(name: str, settings: Settings, rows: list[Row], best: Row | None) -> Table:
    ratios = speedups(rows)
    table = Table(title=f"{name} on {settings.device} at {settings.precision}", title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="right" if column not in ("backend", "status", "parity") else "left")
    for row in rows:
        style = "bold green" if row is best else ("dim" if row.status == "absent" else None)
        table.add_row(*cells(row, ratios.get((row.backend, row.batch))), style=style)
    return table


def generation_table(rows: list[GenerationRow]) -> Table:
    table = Table(title="generation, static KV cache (greedy)", title_justify="left")
    for column in ("mode", "batch", "prompt", "new", "cold", "prefill", "decode tok/s", "same tokens"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for g in rows:
        if g.status != "ok":
            table.add_row(g.mode, str(g.batch), str(g.prompt_tokens), str(g.new_tokens), "failed", "", "", "")
            continue
        table.add_row(
            g.mode,
            str(g.batch),
            str(g.prompt_tokens),
            str(g.new_tokens),
            f"{g.cold_s:.1f} s" if g.cold_s is not None else "",
            _ms(g.prefill_ms),
            f"{g.decode_tokens_per_s:,.1f}" if g.decode_tokens_per_s else "",
            f"{g.agreement:.0%}" if g.agreement is not None else "",
        )
    return table


def verdict(rows: list[Row], best: Row | None, settings: Settings) -> str:
    rejected = sorted({r.backend for r in rows if r.status == "parity"})
    tail = f"; excluded for parity: {', '.join(rejected)}" if rejected else ""
    if best is None:
        slo = f" within {settings.latency_slo_ms:g} ms p99" if settings.latency_slo_ms is not None else ""
        return f"no backend runs this model{slo} with outputs that match eager{tail}"
    ratio = speedups(rows).get((best.backend, best.batch))
    versus = f", {1 / ratio:.2f}x eager's latency at that batch" if ratio else ""
    return (
        f"pick: {best.backend} at batch {best.batch} ({best.precision}): {best.samples_per_s:,.1f} samples/s, "
        f"p99 {_ms(best.p99_ms)}{versus}{tail}"
    )


def latency_plot(rows: list[Row], batches: tuple[int, ...]) -> bytes:
    """p50 latency per backend, one group of bars per batch size, log scale (batch 1 and 32 differ by 10x+)."""
    fig = Figure(figsize=(10, 3.8), dpi=100)
    canvas = FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.88, bottom=0.14)
    ax = fig.add_subplot()
    ax.set_title("p50 latency per call (lower is faster); hatched: failed parity", loc="left", fontsize=11)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    names = list(dict.fromkeys(r.backend for r in rows if r.p50_ms))
    width = 0.8 / max(1, len(names))
    labelled: set[str] = set()
    for index, name in enumerate(names):
        for position, batch in enumerate(batches):
            row = next((r for r in rows if r.backend == name and r.batch == batch and r.p50_ms), None)
            if row is None or row.p50_ms is None:  # the filter above took rows with a p50 only
                continue
            ax.bar(
                position + index * width,
                row.p50_ms,
                width,
                color=f"C{index}",
                hatch="//" if row.status == "parity" else None,
                label=None if name in labelled else name,
            )
            labelled.add(name)
    ax.set_xticks([p + 0.4 - width / 2 for p in range(len(batches))], [f"batch {b}" for b in batches])
    ax.legend(fontsize="small", frameon=False, ncol=min(4, max(1, len(names))))
    ax.grid(True, axis="y", color="#e4e8ee", linewidth=0.6)
    buf = io.BytesIO()
    canvas.print_png(buf, metadata={"Software": GENERATOR})
    return buf.getvalue()


def html_report(name: str, rows: list[Row], best: Row | None, generated: list[GenerationRow], settings: Any) -> str:
    ratios = speedups(rows)
    png = base64.b64encode(latency_plot(rows, settings.batches)).decode()
    header = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells(r, ratios.get((r.backend, r.batch)))) + "</tr>"
        for r in rows
    )
    generation = ""
    if generated:
        lines = "".join(
            f"<li>{escape(g.mode)}: prefill {_ms(g.prefill_ms)}, decode {g.decode_tokens_per_s or 0:,.1f} tokens/s, "
            f"cold start {g.cold_s or 0:.1f} s, same tokens as eager {g.agreement or 0:.0%} {escape(g.note)}</li>"
            for g in generated
        )
        generation = f"<h2>Generation (static KV cache)</h2><ul>{lines}</ul>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">
<title>redline infer: {escape(name)}</title><style>{CSS}</style></head>
<body>
<h1>redline infer: {escape(name)}</h1>
<p>{escape(verdict(rows, best, settings))}</p>
<figure><img alt="p50 latency per backend and batch" src="data:image/png;base64,{png}"></figure>
<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>
<ul class="notes">{"".join(f"<li>{escape(n)}</li>" for n in notes(rows))}</ul>
{generation}
<footer>redline {escape(__version__)}</footer>
</body></html>
"""
