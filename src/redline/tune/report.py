"""The tune's HTML report: one self-contained page (inline CSS, the plot as a base64 PNG, nothing fetched) with
the samples per second of every trial in the order the search ran them, the baseline's and the winner's marked,
and the table of trials with why each that did not run or count did not.

Drawn with matplotlib's object API (``Figure`` + ``FigureCanvasAgg``), as ``monitor/report.py`` draws, so a
caller's backend is left alone.
"""

from __future__ import annotations

import base64
import io
import statistics
from html import escape
from typing import cast

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from redline import __version__
from redline.report.html import CSS
from redline.tune.search import Outcome, Trial, spread

GENERATOR = "redline tune report"
STATUS_COLOURS = {"ok": "#3b6fb6", "oom": "#c0392b", "pruned": "#b0b7c3", "failed": "#8e44ad", "hang": "#8e44ad"}


def throughput_plot(outcome: Outcome) -> bytes:
    """A bar per trial (its samples per second; a trial that did not run to the end has a short grey stub at
    the baseline's tenth, so it still has its place), the baseline as a dashed line, the winner outlined."""
    fig = Figure(figsize=(10, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.88, bottom=0.2)
    ax = fig.add_subplot()
    ax.set_title("samples/s per trial, in the order the search ran them", loc="left", fontsize=11)
    ax.set_ylabel("samples/s")
    stub = (outcome.baseline.samples_per_s or 1.0) / 10
    for index, trial in enumerate(outcome.trials):
        result = trial.result
        winner = trial.candidate is not None and trial.candidate == outcome.winner and result.status == "ok"
        ax.bar(
            index,
            result.samples_per_s or stub,
            color=STATUS_COLOURS.get(result.status, "#b0b7c3"),
            edgecolor="#111111" if winner else "none",
            linewidth=2 if winner else 0,
        )
    if outcome.baseline.samples_per_s:
        ax.axhline(outcome.baseline.samples_per_s, color="#5a6475", linestyle="--", linewidth=1, label="baseline")
        ax.legend(loc="upper left", fontsize="small", frameon=False)
    ax.set_xticks(range(len(outcome.trials)), [t.label for t in outcome.trials], rotation=35, fontsize=7, ha="right")
    ax.grid(True, axis="y", color="#e4e8ee", linewidth=0.6)
    buf = io.BytesIO()
    cast(FigureCanvasAgg, fig.canvas).print_png(buf, metadata={"Software": GENERATOR})  # the canvas made above
    return buf.getvalue()


def html_report(outcome: Outcome, script: str) -> str:
    png = base64.b64encode(throughput_plot(outcome)).decode()
    rows = "".join(_row(index, trial, outcome) for index, trial in enumerate(outcome.trials))
    header = "".join(f"<th>{escape(name)}</th>" for name in ("#", *COLUMNS))
    if outcome.winner is not None:
        verdict = (
            f"<p><b>winner</b>: {escape(outcome.winner.key())}: {outcome.winner_speed:,.1f} samples/s, "
            f"{outcome.speedup:.2f}x the baseline; loss parity: {escape(str(outcome.parity))}</p>"
        )
    else:
        verdict = "<p>No candidate trained as the baseline does.</p>"
    spread = f"<p>{escape(noise_line(outcome))}</p>" if outcome.spread is not None else ""
    stopped = f"<p>Stopped early: {escape(outcome.stopped)}.</p>" if outcome.stopped else ""
    stopped += f"<p>{escape(planner_line(outcome))}</p>" if outcome.predicted_default else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">
<title>redline tune: {escape(script)}</title><style>{CSS}</style></head>
<body>
<h1>redline tune: {escape(script)}</h1>
{verdict}{spread}{stopped}
<figure><img alt="samples per second per trial" src="data:image/png;base64,{png}"></figure>
<table><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>
<footer>redline {escape(__version__)}</footer>
</body></html>
"""


COLUMNS = ("for", "config", "samples/s", "median of runs", "planned/s", "step ms", "startup s", "peak GiB", "status")
NUMERIC = COLUMNS[2:8]  # right-aligned


def noise_line(outcome: Outcome) -> str:
    """What the repeats measured, as a sentence."""
    return (
        f"Runs of one config differed by up to {outcome.spread:.1%} of their median ({outcome.noise or 0.0:.1%} "
        "but for the config whose runs differed most): a change had to gain more than that (its median over "
        "repeats against the leader's) to count."
    )


def planner_line(outcome: Outcome) -> str:
    """The planner's view of the default and the winner against what they measured, as a sentence."""
    assert outcome.predicted_default is not None and outcome.predicted_winner is not None
    return (
        f"The planner predicted {outcome.predicted_default:,.1f} samples/s for the default (measured "
        f"{outcome.baseline_speed:,.1f}) and {outcome.predicted_winner:,.1f} for the winner (measured "
        f"{outcome.winner_speed or 0:,.1f}); planned/s is its figure for each trial, before any measurement."
    )


def median_cell(runs: tuple[float, ...]) -> str:
    """A config's median and spread over its runs, where it ran more than once: what the search compared (the
    speed it ranks by, ``Tuner._speed``)."""
    if len(runs) < 2:
        return ""
    return f"{statistics.median(runs):,.1f} (spread {spread(runs):.1%} over {len(runs)} runs)"


def trial_cells(trial: Trial, outcome: Outcome) -> list[str]:
    """A trial's row, as the terminal table and the page show it (``COLUMNS``): its config's median over its
    runs on the config's first trial."""
    result = trial.result
    key = None if trial.candidate is None else trial.candidate.key()
    first = key is not None and next(t for t in outcome.trials if t.candidate == trial.candidate) is trial
    return [
        trial.label,
        "baseline (redline run as it is)" if key is None else key,
        f"{result.samples_per_s:,.1f}" if result.samples_per_s else "",
        median_cell(outcome.scores.get(key, ())) if first and key is not None else "",
        f"{trial.predicted.samples_per_s:,.1f}" if trial.predicted else "",
        f"{result.step_s * 1e3:,.1f}" if result.step_s else "",
        f"{result.startup_s:.1f}" if result.startup_s is not None else "",
        f"{result.peak_memory_bytes / 2**30:.2f}" if result.peak_memory_bytes else "",
        result.status + (" (journal)" if trial.cached else "") + (f": {result.why}" if result.why else ""),
    ]


def _row(index: int, trial: Trial, outcome: Outcome) -> str:
    cells = [str(index), *trial_cells(trial, outcome)]
    return "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in cells) + "</tr>"
