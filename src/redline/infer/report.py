"""What `redline infer` shows: the terminal tables (rich), the verdict line, and one self-contained HTML page
(inline CSS, the plot as a base64 PNG drawn with matplotlib's object API, as the tune's report draws)."""

from __future__ import annotations

import base64
import io
from html import escape
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich import box
from rich.table import Table

from redline import __version__
from redline.infer.backends import REFERENCE
from redline.infer.generate import GenerationRow
from redline.infer.measure import Row, Settings, speedups
from redline.report.html import CSS
from redline.units import fmt_bytes

GENERATOR = "redline infer report"
# two tables, each readable at 80 columns: what a backend serves at, and what it costs and how close it comes
SPEED_COLUMNS = ("backend", "batch", "p50 ms", "p99 ms", "samples/s", "speed-up", "status")
BUILD_COLUMNS = ("backend", "batch", "cold s", "memory", "rel err", "top-1")
# under each table, one line each at 80 columns
SPEED_NOTES = (
    "speed-up: eager's p50 over this p50, same batch (2.00x: twice as fast)",
    "samples/s: batch / p50, so at one batch its ratio to eager's is the speed-up",
)
BUILD_NOTES = (
    "cold s: build (export, compile) and first call; memory: peak meanwhile",
    "rel err: largest error / eager fp32's largest value; top-1: arg-max agrees",
)
GENERATION_COLUMNS = ("mode", "compiled", "cold s", "prefill ms", "decode tok/s", "speed-up", "same tokens")
GENERATION_NOTES = (
    "prefill runs eager in both modes: one figure, the median of both modes' runs",
    "speed-up: decode tokens/s over eager's; same tokens: greedy tokens as eager's",
)


def _number(value: float | None) -> str:
    """A latency or a rate: two decimals below 100, whole numbers with thousands separators above."""
    return "" if value is None else f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{_number(value)} ms"


def _times(speedup: float | None) -> str:
    return "" if speedup is None else f"{speedup:.2f}x"


def _versus(speedup: float) -> str:
    """A speed-up over eager in words: N.NNx faster or N.NNx slower, the ratio 1 or more either way, so that no
    reader has to know which way up a ratio below 1 is."""
    if f"{speedup:.2f}" == "1.00":
        return "as fast as eager"
    return f"{speedup:.2f}x faster than eager" if speedup > 1 else f"{1 / speedup:.2f}x slower than eager"


def status(row: Row) -> str:
    """ok, over SLO (ran and matched, p99 past --latency-slo), parity (outputs differ), failed, absent."""
    return "over SLO" if row.status == "ok" and row.meets_slo is False else row.status


def speed_cells(row: Row, speedup: float | None) -> list[str]:
    """A row's latency, throughput and speed-up (eager's p50 over its own) as text."""
    return [
        row.backend,
        str(row.batch),
        _number(row.p50_ms),
        _number(row.p99_ms),
        _number(row.samples_per_s),
        _times(speedup),
        status(row),
    ]


def build_cells(row: Row) -> list[str]:
    """A row's cold start, peak memory and parity as text."""
    parity = row.parity
    return [
        row.backend,
        str(row.batch),
        "" if row.cold_s is None else f"{row.cold_s:.1f}",
        "" if row.peak_memory_bytes is None else fmt_bytes(row.peak_memory_bytes),
        "" if parity is None else f"{parity.max_rel:.1e}",
        "" if parity is None or parity.top1 is None else f"{parity.top1:.0%}",
    ]


def shown(rows: list[Row]) -> list[Row]:
    """The rows the tables show: a backend that cannot run here is a note (``notes``), not a row per batch."""
    return [r for r in rows if r.status != "absent"]


def notes(rows: list[Row]) -> list[str]:
    """Why each backend that did not run (or did not match) did not, once per backend and reason."""
    said = dict.fromkeys(f"{r.backend}: {r.status}: {r.note}" for r in rows if r.status != "ok" and r.note)
    return list(said)


def plain_table(title: str, columns: tuple[str, ...]) -> Table:
    """A table of infer's, without side borders or doubled padding (the column gaps are two spaces): the widest
    fits 80 columns with compile-max-autotune in it. Names and words left, figures right."""
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True
    )
    for column in columns:
        left = column in ("backend", "status", "mode", "compiled", "what", "here")
        table.add_column(column, justify="left" if left else "right", no_wrap=column in ("backend", "mode"))
    return table


def speed_table(name: str, settings: Settings, rows: list[Row], best: Row | None) -> Table:
    speedup = speedups(rows)
    table = plain_table(f"{name} on {settings.device} at {settings.precision}: latency per call", SPEED_COLUMNS)
    for row in shown(rows):
        style = "bold green" if row is best else None
        table.add_row(*speed_cells(row, speedup.get((row.backend, row.batch))), style=style)
    return table


def build_table(rows: list[Row], best: Row | None) -> Table:
    table = plain_table("cold start, memory and parity against eager fp32", BUILD_COLUMNS)
    for row in shown(rows):
        table.add_row(*build_cells(row), style="bold green" if row is best else None)
    return table


def generation_title(rows: list[GenerationRow]) -> str:
    first = rows[0]
    return (
        f"generation: batch {first.batch}, {first.prompt_tokens}-token prompt, {first.new_tokens} new tokens "
        "(greedy, static KV cache)"
    )


def generation_cells(row: GenerationRow, eager: GenerationRow | None) -> list[str]:
    """A generation row as text; the speed-up is of its decode over eager's."""
    if row.status != "ok":
        return [row.mode, row.compiled, "failed", "", "", "", ""]
    base = eager.decode_tokens_per_s if eager is not None and eager.status == "ok" else None
    rate = row.decode_tokens_per_s
    return [
        row.mode,
        row.compiled,
        "" if row.cold_s is None else f"{row.cold_s:.1f}",
        _number(row.prefill_ms),
        "" if rate is None else f"{rate:,.1f}",
        _times(rate / base if rate and base else None),
        "" if row.agreement is None else f"{row.agreement:.0%}",
    ]


def generation_table(rows: list[GenerationRow]) -> Table:
    table = plain_table(generation_title(rows), GENERATION_COLUMNS)
    eager = next((g for g in rows if g.mode == "eager"), None)
    for g in rows:
        table.add_row(*generation_cells(g, eager))
    return table


def verdict(rows: list[Row], best: Row | None, settings: Settings) -> str:
    rejected = sorted({r.backend for r in rows if r.status == "parity"})
    tail = f"; excluded for parity: {', '.join(rejected)}" if rejected else ""
    if best is None:
        slo = f" within {settings.latency_slo_ms:g} ms p99" if settings.latency_slo_ms is not None else ""
        return f"no backend runs this model{slo} with outputs that match eager{tail}"
    speedup = speedups(rows).get((best.backend, best.batch))
    versus = f", {_versus(speedup)} (p50 at batch {best.batch})" if speedup and best.backend != REFERENCE else ""
    return (
        f"pick: {best.backend} at batch {best.batch} ({best.precision}): {_number(best.samples_per_s)} samples/s, "
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


def _html_table(columns: tuple[str, ...], cells: list[list[str]], footnotes: tuple[str, ...]) -> str:
    """A table as the terminal shows it, its notes below."""
    header = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in cells)
    below = "".join(f'<p class="rule">{escape(n)}</p>' for n in footnotes)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>{below}"


def html_report(name: str, rows: list[Row], best: Row | None, generated: list[GenerationRow], settings: Any) -> str:
    """The page: the verdict, the latency plot, and the terminal's tables with the same headers and notes."""
    speedup = speedups(rows)
    png = base64.b64encode(latency_plot(rows, settings.batches)).decode()
    speed = _html_table(
        SPEED_COLUMNS, [speed_cells(r, speedup.get((r.backend, r.batch))) for r in shown(rows)], SPEED_NOTES
    )
    build = _html_table(BUILD_COLUMNS, [build_cells(r) for r in shown(rows)], BUILD_NOTES)
    generation = ""
    if generated:
        eager = next((g for g in generated if g.mode == "eager"), None)
        table = _html_table(GENERATION_COLUMNS, [generation_cells(g, eager) for g in generated], GENERATION_NOTES)
        generation = f"<h2>{escape(generation_title(generated))}</h2>{table}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">
<title>redline infer: {escape(name)}</title><style>{CSS}</style></head>
<body>
<h1>redline infer: {escape(name)}</h1>
<p>{escape(verdict(rows, best, settings))}</p>
<figure><img alt="p50 latency per backend and batch" src="data:image/png;base64,{png}"></figure>
<h2>Latency per call, on {escape(settings.device)} at {escape(settings.precision)}</h2>{speed}
<h2>Cold start, memory and parity against eager fp32</h2>{build}
<ul class="notes">{"".join(f"<li>{escape(n)}</li>" for n in notes(rows))}</ul>
{generation}
<footer>redline {escape(__version__)}</footer>
</body></html>
"""
