"""`redline report FILE [--html OUT]`: what a monitor record shows, as one offline HTML page or as PNG files.

The page is self-contained (inline CSS, plots as base64 PNG data URIs, no script, nothing fetched), so it can be
copied home from a remote server and opened anywhere; PNGs are for a user in a terminal. Plots are drawn with
matplotlib's object API (``Figure`` + ``FigureCanvasAgg``), never pyplot, so a caller's backend and global
figure state are left alone.

Every line is read from the store's narrow tables, downsampled there to ``max_points`` buckets (mean line, min-max
band), so a day-long record renders in seconds. ``None`` in a sample is a gap in the line, never a zero; a time
gap (the monitor was stopped) breaks the line too, instead of drawing a straight ramp across it.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any, cast

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from redline import __version__
from redline.doctor.model import Finding
from redline.errors import BadInput
from redline.monitor.sample import Sample
from redline.monitor.store import Series, Store
from redline.report.html import CSS, _finding
from redline.report.output import check_target, write_output
from redline.units import GiB, fmt_bytes, fmt_duration

RECORD = "the monitor record"  # what a report must never replace
# in the head of every page and PNG, so a later run knows the file is a redline report it may replace
GENERATOR = "redline monitor report"
MAX_POINTS = 800  # per line: about one per pixel of a plot's width
MAX_NOTES = 200
GAP_FACTOR = 5.0  # a time step this many times the usual one is a gap in the record, not a ramp
_FIGSIZE = (10.0, 3.0)
# tab10, then tab20's lighter shades: 20 GPUs or ranks before a colour repeats
_PALETTE = (
    *("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"),
    *("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"),
)
_DPI = 100
_EXTRA_CSS = """
figure{margin:1rem 0;background:#fff;border:1px solid #d8dde6;border-radius:6px;padding:.4rem}
figure img{width:100%;height:auto;display:block} figcaption{color:#5a6475;font-size:.85rem;margin:.2rem .4rem}
table.stats{border-collapse:collapse;font-variant-numeric:tabular-nums}
table.stats th,table.stats td{padding:.2rem .8rem;border-bottom:1px solid #e4e8ee;text-align:right}
table.gpus td:nth-child(2),table.gpus th:nth-child(2){text-align:left}
"""

Source = Store | str | os.PathLike[str] | Iterable[Sample]


@dataclass(frozen=True)
class Plot:
    """One rendered figure: ``slug`` names its PNG file, ``title`` its caption."""

    slug: str
    title: str
    png: bytes


@dataclass(frozen=True)
class _GpuPlot:
    """A per-GPU figure: ``field`` per GPU, and optionally its ``ceiling`` (a limit, a maximum) dashed."""

    slug: str
    title: str
    ylabel: str
    field: str
    scale: float
    ceiling: str | None = None
    ceiling_label: str = "limit"
    ylim: tuple[float, float] | None = None


GPU_PLOTS = (
    _GpuPlot("gpu-utilization", "GPU utilisation", "%", "utilization_ratio", 100.0, ylim=(0, 105)),
    _GpuPlot("gpu-memory", "GPU memory used", "GiB", "memory_used_bytes", 1 / GiB, "memory_total_bytes", "total"),
    _GpuPlot("gpu-power", "GPU power", "W", "power_watts", 1.0, "power_limit_watts", "power limit"),
    _GpuPlot("gpu-clocks", "SM clock", "MHz", "sm_clock_hertz", 1e-6, "sm_clock_max_hertz", "max clock"),
    _GpuPlot(
        "gpu-temperature",
        "GPU temperature",
        "°C",
        "temperature_celsius",
        1.0,
        "temperature_slowdown_celsius",
        "slowdown",
    ),
)


# every plot, in display order: those with no data are left out of the page and named as not recorded
PLOT_TITLES = {
    **{spec.slug: spec.title for spec in GPU_PLOTS},
    "steps": "training step time and data wait",
    "host-cpu": "host CPU",
}


# -- public API ----------------------------------------------------------------------------------------------


def render_html(
    source: Source,
    findings: Iterable[Finding],
    out_path: str | os.PathLike[str],
    title: str | None = None,
    *,
    start: float | None = None,
    end: float | None = None,
    max_points: int = MAX_POINTS,
) -> Path:
    """Write the report page to ``out_path`` (replacing only a file redline wrote, never the record itself)."""
    out = Path(out_path)
    with _opened(source) as store:
        protect = Path(store.name) if store.name != "<memory>" else None
        # before the work, not after it
        check_target(out, marker=GENERATOR, protect=protect, protected=RECORD)
        page = html_page(store, findings, title, start=start, end=end, max_points=max_points)
    write_output(out, page, marker=GENERATOR, protect=protect, protected=RECORD)
    return out


def render_pngs(
    source: Source,
    out_dir: str | os.PathLike[str],
    *,
    start: float | None = None,
    end: float | None = None,
    max_points: int = MAX_POINTS,
) -> list[Path]:
    """Write each plot as ``out_dir/<slug>.png``; returns their paths in display order."""
    folder = Path(out_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"cannot create {folder} for the plots: {exc.strerror or exc}") from None
    for slug in PLOT_TITLES:
        check_target(folder / f"{slug}.png", marker=GENERATOR)
    with _opened(source) as store:
        plots = build_plots(store, start=start, end=end, max_points=max_points)
    paths = [folder / f"{plot.slug}.png" for plot in plots]
    for path, plot in zip(paths, plots, strict=True):
        write_output(path, plot.png, marker=GENERATOR)  # its text chunk names the generator
    return paths


def html_page(
    store: Store,
    findings: Iterable[Finding],
    title: str | None = None,
    *,
    start: float | None = None,
    end: float | None = None,
    max_points: int = MAX_POINTS,
) -> str:
    """The report page as text: header, time range, per-GPU and per-rank summaries, findings, plots."""
    first, last = _time_range(store, start, end)
    plots = build_plots(store, start=first, end=last, max_points=max_points)
    heading = escape(title or "redline monitor report")
    worst_first = sorted(findings, key=lambda f: (f.severity.rank, str(f.area or ""), f.rule))
    findings_html = "".join(_finding(f) for f in worst_first) or "<p>No findings over this record.</p>"
    figures = "".join(
        f'<figure><img alt="{escape(p.title)}" src="data:image/png;base64,{base64.b64encode(p.png).decode()}">'
        f"<figcaption>{escape(p.title)}</figcaption></figure>"
        for p in plots
    )
    drawn = {p.slug for p in plots}
    absent = [name for slug, name in PLOT_TITLES.items() if slug not in drawn]
    absent_html = f'<p class="rule">Not recorded: {escape(", ".join(absent))}.</p>' if absent else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>{heading}</title><style>{CSS}{_EXTRA_CSS}</style></head>
<body>
<h1>{heading}</h1>
{_overview(store, first, last)}
<h2>Findings</h2>
{findings_html}
<h2>GPUs</h2>
{_gpu_table(store, first, last)}
{_step_table(store, first, last)}
<h2>Over time</h2>
{figures}{absent_html}
{_notes(store, first, last)}
<footer>redline {escape(__version__)}; times in UTC</footer>
</body></html>
"""


def build_plots(
    store: Store, *, start: float | None = None, end: float | None = None, max_points: int = MAX_POINTS
) -> list[Plot]:
    """Every plot the record has data for, in display order; BadInput when the record (or range) is empty."""
    first, last = _time_range(store, start, end)
    # every GPU line of every plot in one query: one scan (and one sort) of the GPU table, not ten
    gpu_fields = [f for spec in GPU_PLOTS for f in (spec.field, spec.ceiling) if f]
    gpu = store.series("gpu", gpu_fields, start=first, end=last, max_points=max_points)
    plots = [_gpu_plot(spec, gpu[spec.field], gpu[spec.ceiling] if spec.ceiling else {}) for spec in GPU_PLOTS]
    steps = store.series("step", ["time_s", "data_s"], start=first, end=last, max_points=max_points)
    plots.append(_step_plot(steps["time_s"], steps["data_s"]))
    host = store.series("host", ["cpu_ratio", "cpu_iowait_ratio"], start=first, end=last, max_points=max_points)
    plots.append(_host_plot(host["cpu_ratio"].get(0), host["cpu_iowait_ratio"].get(0)))
    return [p for p in plots if p is not None]


# -- opening the source --------------------------------------------------------------------------------------


@contextmanager
def _opened(source: Source) -> Iterator[Store]:
    """A Store for any source; closes what it opened, leaves a caller's Store open."""
    if isinstance(source, Store):
        yield source
        return
    store = Store.read(source) if isinstance(source, str | os.PathLike) else Store.from_samples(source)
    try:
        yield store
    finally:
        store.close()


def _time_range(store: Store, start: float | None, end: float | None) -> tuple[float, float]:
    span = store.time_range()
    if span is None:
        raise BadInput(f"monitor record {store.name} holds no samples: nothing to report")
    first, last = (
        max(span[0], start) if start is not None else span[0],
        min(span[1], end) if end is not None else span[1],
    )
    if first > last or not store.count(first, last):
        since = "the start" if start is None else _utc(start)
        until = "the end" if end is None else _utc(end)
        raise BadInput(f"monitor record {store.name} holds no samples between {since} and {until}")
    return first, last


# -- plots ---------------------------------------------------------------------------------------------------


def _gpu_plot(spec: _GpuPlot, lines: dict[int, Series], ceilings: dict[int, Series]) -> Plot | None:
    if not _has_values(lines.values()):
        return None
    fig, ax = _figure(spec.title, spec.ylabel)
    for gpu, series in lines.items():
        _draw(ax, series, spec.scale, band=_band_alpha(len(lines)), color=_color(gpu), label=f"GPU {gpu}")
    _draw_ceiling(ax, ceilings, spec)
    if spec.ylim:
        ax.set_ylim(*spec.ylim)
    return Plot(spec.slug, spec.title, _png(fig, ax))


def _draw_ceiling(ax: Axes, ceilings: dict[int, Series], spec: _GpuPlot) -> None:
    """One grey dashed line when every GPU has the same constant ceiling (the usual case: eight identical
    limits drawn eight times would only blur), else a dashed line per GPU in its colour."""
    if not _has_values(ceilings.values()):
        return
    distinct = {v for s in ceilings.values() for v in s.values if v is not None}
    if len(distinct) == 1:
        ax.axhline(distinct.pop() * spec.scale, color="#5a6475", linestyle="--", linewidth=1, label=spec.ceiling_label)
        return
    for gpu, series in ceilings.items():
        _draw(ax, series, spec.scale, band=0, color=_color(gpu), linestyle="--", linewidth=0.8)
    ax.plot([], [], color="#5a6475", linestyle="--", linewidth=0.8, label=spec.ceiling_label)


def _step_plot(step: dict[int, Series], data: dict[int, Series]) -> Plot | None:
    if not _has_values(step.values()):
        return None
    fig, ax = _figure("Training step time (solid) and data wait (dotted)", "s")
    for rank, series in step.items():
        _draw(ax, series, 1.0, band=_band_alpha(len(step)), color=_color(rank), label=f"rank {rank}")
        if rank in data:
            _draw(ax, data[rank], 1.0, band=0, color=_color(rank), linestyle=":")
    ax.set_ylim(bottom=0)
    return Plot("steps", "Training step time and data wait per rank", _png(fig, ax))


def _host_plot(cpu: Series | None, iowait: Series | None) -> Plot | None:
    lines = [s for s in (cpu, iowait) if s is not None]
    if not _has_values(lines):
        return None
    fig, ax = _figure("Host CPU", "%")
    if cpu is not None:
        _draw(ax, cpu, 100.0, band=_band_alpha(1), color="#1e63c4", label="CPU busy")
    if iowait is not None:
        _draw(ax, iowait, 100.0, band=0, color="#c62828", label="I/O wait")
    ax.set_ylim(0, 105)
    return Plot("host-cpu", "Host CPU busy and I/O wait", _png(fig, ax))


def _figure(title: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI)
    FigureCanvasAgg(fig)
    # fixed margins, the legend in the right one: constrained layout would measure every tick label of every
    # figure again, which cost as much as drawing the lines
    fig.subplots_adjust(left=0.07, right=0.85, top=0.88, bottom=0.14)
    ax = fig.add_subplot()
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("UTC", fontsize=8, color="#5a6475", loc="left")
    ax.grid(True, color="#e4e8ee", linewidth=0.6)
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    return fig, ax


def _draw(ax: Axes, series: Series, scale: float, *, band: float, **style: Any) -> None:
    """One line, with gaps where values are None or the record has a hole; when the store downsampled it, the
    bucket min-max band behind it at opacity ``band`` (0: none)."""
    times, values = _with_gaps(series.times, series.values, scale)
    ax.plot(times, values, linewidth=style.pop("linewidth", 1.1), **style)
    if band and series.downsampled:
        _, lows = _with_gaps(series.times, series.lows or [], scale)
        _, highs = _with_gaps(series.times, series.highs or [], scale)
        ax.fill_between(times, lows, highs, color=style.get("color"), alpha=band, linewidth=0)


def _band_alpha(lines: int) -> float:
    """Fainter bands the more lines share a plot: eight GPUs' bands at full strength are one grey blob."""
    return 0.3 / (lines + 1)


def _with_gaps(times: Sequence[float], values: Sequence[float | None], scale: float) -> tuple[np.ndarray, np.ndarray]:
    """datetime64 times and scaled values, None as NaN, and a NaN point inserted in every time hole wider than
    ``GAP_FACTOR`` usual steps, so matplotlib breaks the line there."""
    t = np.asarray(times, dtype=float)
    v = np.array([math.nan if x is None else float(x) * scale for x in values], dtype=float)
    if t.size > 2:
        steps = np.diff(t)
        usual = float(np.median(steps[steps > 0])) if np.any(steps > 0) else 0.0
        holes = np.nonzero(steps > GAP_FACTOR * usual)[0] + 1 if usual > 0 else np.array([], dtype=int)
        if holes.size:
            t = np.insert(t, holes, (t[holes - 1] + t[holes]) / 2)
            v = np.insert(v, holes, math.nan)
    return (t * 1e6).astype("datetime64[us]"), v


def _png(fig: Figure, ax: Axes) -> bytes:
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(
            loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False, ncols=1 + len(handles) // 13
        )
    buf = io.BytesIO()
    canvas = cast(FigureCanvasAgg, fig.canvas)  # the one _figure attached
    canvas.print_png(buf, metadata={"Software": GENERATOR})
    return buf.getvalue()


def _color(key: int) -> str:
    """A stable colour per GPU/rank, the same in every plot."""
    return _PALETTE[key % len(_PALETTE)]


def _has_values(series: Iterable[Series]) -> bool:
    return any(v is not None for s in series for v in s.values)


# -- tables --------------------------------------------------------------------------------------------------


def _overview(store: Store, first: float, last: float) -> str:
    latest = store.latest()
    gpus = store.gpu_indices()
    names = {g.index: g.name for g in latest.gpus} if latest else {}
    models = sorted({names.get(i) or "unknown" for i in gpus})
    rows = {
        "record": store.name,
        "from": _utc(first),
        "to": _utc(last),
        "duration": fmt_duration(last - first),
        "samples": f"{store.count(first, last):,}",
        "GPUs": f"{len(gpus)} ({', '.join(models)})" if gpus else "none recorded",
        "training ranks": ", ".join(map(str, store.ranks())) or "no steps recorded",
    }
    return (
        '<table class="summary">'
        + "".join(f"<tr><td>{k}</td><td>{escape(v)}</td></tr>" for k, v in rows.items())
        + "</table>"
    )


def _gpu_table(store: Store, first: float, last: float) -> str:
    stats = store.gpu_stats(first, last)
    if not stats:
        return "<p>No GPU was recorded.</p>"
    latest = store.latest()
    names = {g.index: g.name for g in latest.gpus} if latest else {}
    head = "<tr><th>GPU</th><th>name</th><th>util mean</th><th>util p95</th><th>peak memory</th><th>power mean</th>"
    head += "<th>energy</th><th>max temp</th></tr>"
    rows = []
    for gpu, s in stats.items():
        memory = fmt_bytes(s.memory_peak_bytes)
        if s.memory_total_bytes:
            memory += f" of {fmt_bytes(s.memory_total_bytes)}"
        cells = (
            str(gpu),
            names.get(gpu) or "",
            _pct(s.utilization_mean_ratio),
            _pct(s.utilization_p95_ratio),
            memory,
            _fmt(s.power_mean_watts, "{:.0f} W"),
            _energy(s.energy_joules),
            _fmt(s.temperature_max_celsius, "{:.0f} °C"),
        )
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return f'<table class="stats gpus">{head}{"".join(rows)}</table>'


def _step_table(store: Store, first: float, last: float) -> str:
    stats = store.step_stats(first, last)
    if not stats:
        return ""
    head = "<tr><th>rank</th><th>steps</th><th>step time mean</th><th>data wait mean</th><th>data wait share</th></tr>"
    rows = "".join(
        f"<tr><td>{rank}</td><td>{s.steps:,}</td><td>{_fmt(s.time_mean_s, '{:.3f} s')}</td>"
        f"<td>{_fmt(s.data_mean_s, '{:.3f} s')}</td><td>{_pct(s.data_share_ratio)}</td></tr>"
        for rank, s in stats.items()
    )
    return f'<h2>Training steps</h2><table class="stats">{head}{rows}</table>'


def _notes(store: Store, first: float, last: float) -> str:
    """What the monitor could not read, and when (NVML gone, a metrics file unreadable): the first
    ``MAX_NOTES``, since a broken setup can repeat one problem all day."""
    notes = store.notes(first, last)
    if not notes:
        return ""
    items = "".join(f"<li>{escape(_utc(t))}: {escape(text)}</li>" for t, text in notes[:MAX_NOTES])
    more = f"<li>... and {len(notes) - MAX_NOTES} more</li>" if len(notes) > MAX_NOTES else ""
    return f'<h2>Notes</h2><ul class="notes">{items}{more}</ul>'


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else pattern.format(value)


def _pct(ratio: float | None) -> str:
    return _fmt(None if ratio is None else ratio * 100, "{:.0f}%")


def _energy(joules: float | None) -> str:
    if joules is None:
        return "n/a"
    wh = joules / 3600
    return f"{wh / 1000:.2f} kWh" if wh >= 1000 else f"{wh:.1f} Wh"


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
