"""Reading a monitor record's narrow tables for plots and summaries (the format is ``record_format``'s).

Every function takes an open SQLite connection; ``Store`` holds the connection and its lock, and calls these
under it.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redline.monitor.record_format import ENERGY_FIELD, GPU_TABLE, ROLLUP_S, STEP_TABLE, TABLES, Table

P95_SAMPLE_LIMIT = 20_000  # p95 is exact up to this many samples, from an even subsample of them beyond


@dataclass(frozen=True)
class Series:
    """One line of a plot. ``lows``/``highs`` are the min/max of each bucket when the store downsampled it
    (``values`` are then bucket means), so a plot can still show the dips a mean hides. ``None`` is a gap."""

    times: list[float]
    values: list[float | None]
    lows: list[float | None] | None = None
    highs: list[float | None] | None = None

    @property
    def downsampled(self) -> bool:
        return self.lows is not None


@dataclass(frozen=True)
class GpuStats:
    """What one GPU did over a time range, for the report's summary table."""

    gpu: int
    samples: int
    utilization_mean_ratio: float | None
    utilization_p95_ratio: float | None
    memory_peak_bytes: int | None
    memory_total_bytes: int | None
    power_mean_watts: float | None
    energy_joules: float | None  # from the energy counter; from power x time where the GPU has no counter
    temperature_max_celsius: float | None


@dataclass(frozen=True)
class StepStats:
    """What one rank's training steps took over a time range."""

    rank: int
    steps: int
    time_mean_s: float | None
    data_mean_s: float | None
    data_share_ratio: float | None  # of all step time, how much was waiting for data


def series(
    conn: sqlite3.Connection,
    table: str,
    fields: Sequence[str],
    key: int | None = None,
    start: float | None = None,
    end: float | None = None,
    max_points: int | None = None,
) -> dict[str, dict[int, Series]]:
    """Several fields of one table ("gpu", "host" or "step") at once: field -> key (GPU index, rank; 0 for
    the host) -> Series. Raw rows while a line has at most ``max_points``; else that many time buckets of
    mean/min/max, from the rollups when a bucket spans at least ``ROLLUP_S``, from raw rows otherwise
    (then the range is short, so the rows are few). One query serves all the fields."""
    spec = TABLES.get(table)
    if spec is None:
        raise ValueError(f"no table {table!r}; the tables are: {', '.join(TABLES)}")
    for field in fields:
        spec.check(field)
    span = _span(conn, spec, start, end, key)
    if span is None:
        return {f: {} for f in fields}
    t0, t1 = span
    if not max_points or t1 <= t0 or _most_rows(conn, spec, t0, t1, key) <= max_points:
        return _raw(conn, spec, fields, t0, t1, key)
    width = (t1 - t0) / max(1, max_points - 1)
    if width >= ROLLUP_S:
        return _bucketed_rollup(conn, spec, fields, t0, t1, key, width)
    return _bucketed_raw(conn, spec, fields, t0, t1, key, width)


def _key_filter(spec: Table, key: int | None) -> tuple[str, tuple[int, ...]]:
    return (f" AND {spec.key} = ?", (key,)) if key is not None and spec.key else ("", ())


def _span(
    conn: sqlite3.Connection, spec: Table, start: float | None, end: float | None, key: int | None
) -> tuple[float, float] | None:
    """First and last row time in the range (two index probes, not a scan)."""
    lo = -math.inf if start is None else float(start)
    hi = math.inf if end is None else float(end)
    key_sql, key_args = _key_filter(spec, key)
    ends = []
    for order in ("ASC", "DESC"):
        row = conn.execute(
            f"SELECT time FROM {spec.name} WHERE time >= ? AND time <= ?{key_sql} ORDER BY time {order} LIMIT 1",
            (lo, hi, *key_args),
        ).fetchone()
        if row is None:
            return None
        ends.append(row[0])
    return ends[0], ends[1]


def _most_rows(conn: sqlite3.Connection, spec: Table, t0: float, t1: float, key: int | None) -> int:
    """Rows of the longest line in the range, from the rollup (whole buckets: close enough to choose)."""
    key_sql, key_args = _key_filter(spec, key)
    group = f"GROUP BY {spec.key}" if spec.key else ""
    row = conn.execute(
        f"SELECT MAX(n) FROM (SELECT SUM(n) AS n FROM {spec.rollup} WHERE bucket BETWEEN ? AND ?{key_sql} {group})",
        (math.floor(t0 / ROLLUP_S), math.floor(t1 / ROLLUP_S), *key_args),
    ).fetchone()
    return row[0] or 0


def _raw(
    conn: sqlite3.Connection, spec: Table, fields: Sequence[str], t0: float, t1: float, key: int | None
) -> dict[str, dict[int, Series]]:
    key_sql, key_args = _key_filter(spec, key)
    rows = conn.execute(
        f"SELECT {spec.key_expr}, time, {', '.join(fields)} FROM {spec.name}"
        f" WHERE time >= ? AND time <= ?{key_sql} ORDER BY time",
        (t0, t1, *key_args),
    )
    return _split(rows, fields, bucketed=False)


def _bucketed_raw(
    conn: sqlite3.Connection,
    spec: Table,
    fields: Sequence[str],
    t0: float,
    t1: float,
    key: int | None,
    width: float,
) -> dict[str, dict[int, Series]]:
    key_sql, key_args = _key_filter(spec, key)
    aggregates = ", ".join(f"AVG({f}), MIN({f}), MAX({f})" for f in fields)
    group = f"{spec.key + ', ' if spec.key else ''}CAST((time - ?) / ? AS INTEGER)"
    rows = conn.execute(
        f"SELECT {spec.key_expr}, AVG(time), {aggregates} FROM {spec.name}"
        f" WHERE time >= ? AND time <= ?{key_sql} GROUP BY {group} ORDER BY 2",
        (t0, t1, *key_args, t0, width),
    )
    return _split(rows, fields, bucketed=True)


def _bucketed_rollup(
    conn: sqlite3.Connection,
    spec: Table,
    fields: Sequence[str],
    t0: float,
    t1: float,
    key: int | None,
    width: float,
) -> dict[str, dict[int, Series]]:
    """Buckets of ``width`` seconds made of whole rollup buckets (``width >= ROLLUP_S``): the ends of the range
    are rounded out to whole rollup buckets, which a plot cannot show."""
    key_sql, key_args = _key_filter(spec, key)
    aggregates = ", ".join(f"SUM({f}_sum) / NULLIF(SUM({f}_n), 0), MIN({f}_min), MAX({f}_max)" for f in fields)
    group = f"{spec.key + ', ' if spec.key else ''}CAST(((bucket + 0.5) * ? - ?) / ? AS INTEGER)"
    rows = conn.execute(
        f"SELECT {spec.key_expr}, SUM(t_sum) / SUM(n), {aggregates} FROM {spec.rollup}"
        f" WHERE bucket BETWEEN ? AND ?{key_sql} GROUP BY {group} ORDER BY 2",
        (math.floor(t0 / ROLLUP_S), math.floor(t1 / ROLLUP_S), *key_args, ROLLUP_S, t0, width),
    )
    return _split(rows, fields, bucketed=True)


def gpu_stats(conn: sqlite3.Connection, start: float | None, end: float | None) -> dict[int, GpuStats]:
    """Per GPU: mean and p95 utilisation, peak memory, mean power, energy, hottest temperature."""
    wanted = [
        ("mean", "utilization_ratio"),
        ("max", "memory_used_bytes"),
        ("max", "memory_total_bytes"),
        ("mean", "power_watts"),
        ("sum", ENERGY_FIELD),
        ("max", "temperature_celsius"),
    ]
    summary = _summary(conn, GPU_TABLE, wanted, start, end)
    p95 = _p95(conn, "utilization_ratio", start, end)
    return {
        gpu: GpuStats(
            gpu=gpu,
            samples=n,
            utilization_mean_ratio=util,
            utilization_p95_ratio=p95.get(gpu),
            memory_peak_bytes=None if mem is None else int(mem),
            memory_total_bytes=None if total is None else int(total),
            power_mean_watts=power,
            energy_joules=energy,
            temperature_max_celsius=temp,
        )
        for gpu, (n, util, mem, total, power, energy, temp) in summary.items()
    }


def step_stats(conn: sqlite3.Connection, start: float | None, end: float | None) -> dict[int, StepStats]:
    """Per rank: how many steps, their mean time, mean data wait and its share of the step time."""
    wanted = [("mean", "time_s"), ("mean", "data_s"), ("sum", "time_s"), ("sum", "data_s")]
    summary = _summary(conn, STEP_TABLE, wanted, start, end)
    return {
        rank: StepStats(rank, n, t, d, d_sum / t_sum if d_sum is not None and t_sum else None)
        for rank, (n, t, d, t_sum, d_sum) in summary.items()
    }


def _summary(
    conn: sqlite3.Connection,
    spec: Table,
    wanted: Sequence[tuple[str, str]],
    start: float | None,
    end: float | None,
) -> dict[int, tuple]:
    """key -> (rows, then each (kind, field) of ``wanted``: mean, max or sum over the range, None where the
    field was never known). Exact: whole rollup buckets inside the range, raw rows at its two ragged ends,
    combined as partial sums (count, sum, min, max) before the final aggregate."""
    span = _span(conn, spec, start, end, None)
    if span is None:
        return {}
    t0, t1 = span
    first, last = math.ceil(t0 / ROLLUP_S), math.floor(t1 / ROLLUP_S) - 1  # buckets wholly inside [t0, t1]
    names = sorted({f for _, f in wanted})
    key = spec.key_expr
    # the first SELECT of a UNION names the columns: the raw part's partial sums take the rollup's names
    raw_parts = ", ".join(
        f"COUNT({f}) AS {f}_n, TOTAL({f}) AS {f}_sum, MIN({f}) AS {f}_min, MAX({f}) AS {f}_max" for f in names
    )
    rollup_parts = ", ".join(f"{f}_n, {f}_sum, {f}_min, {f}_max" for f in names)
    if first <= last:
        raw_where = "(time >= ? AND time < ?) OR (time >= ? AND time <= ?)"
        raw_args: tuple = (t0, first * ROLLUP_S, (last + 1) * ROLLUP_S, t1)
        rollup = f" UNION ALL SELECT {key}, n, {rollup_parts} FROM {spec.rollup} WHERE bucket BETWEEN ? AND ?"
        rollup_args: tuple = (first, last)
    else:  # the range lies within one or two buckets: raw rows only
        raw_where, raw_args, rollup, rollup_args = "time >= ? AND time <= ?", (t0, t1), "", ()
    finals = {
        "mean": "SUM({f}_sum) / NULLIF(SUM({f}_n), 0)",
        "max": "MAX({f}_max)",
        "sum": "CASE WHEN SUM({f}_n) > 0 THEN SUM({f}_sum) END",
    }
    select = ", ".join(finals[kind].format(f=f) for kind, f in wanted)
    group = f"GROUP BY {spec.key}" if spec.key else ""
    sql = (
        f"SELECT k, SUM(n), {select} FROM ("
        f"SELECT {key} AS k, COUNT(*) AS n, {raw_parts} FROM {spec.name} WHERE {raw_where} {group}"
        f"{rollup}) GROUP BY k ORDER BY k"
    )
    return {row[0]: row[1:] for row in conn.execute(sql, (*raw_args, *rollup_args)) if row[1]}


def _p95(conn: sqlite3.Connection, field: str, start: float | None, end: float | None) -> dict[int, float]:
    """Nearest-rank 95th percentile per GPU: exact up to ``P95_SAMPLE_LIMIT`` samples, else of every k-th
    sample (sample ids run in time order, so the subsample is even over the range)."""
    where, args = window(start, end)
    n = conn.execute(f"SELECT COUNT(*) FROM samples {where}", args).fetchone()[0]
    stride = max(1, math.ceil(n / P95_SAMPLE_LIMIT))
    clause = f"{where} AND" if where else "WHERE"
    values: dict[int, list[float]] = {}
    rows = conn.execute(
        f"SELECT gpu, {field} FROM gpu {clause} {field} IS NOT NULL AND sample % ? = 0", (*args, stride)
    )
    for gpu, value in rows:
        values.setdefault(gpu, []).append(value)
    out = {}
    for gpu, vs in values.items():
        vs.sort()
        out[gpu] = vs[max(0, math.ceil(0.95 * len(vs)) - 1)]
    return out


def window(start: float | None, end: float | None) -> tuple[str, tuple[float, ...]]:
    """A WHERE clause on ``time`` (inclusive both ends) and its arguments."""
    parts, args = [], []
    if start is not None:
        parts.append("time >= ?")
        args.append(float(start))
    if end is not None:
        parts.append("time <= ?")
        args.append(float(end))
    return ("WHERE " + " AND ".join(parts) if parts else ""), tuple(args)


def _split(rows: Iterable[tuple], fields: Sequence[str], bucketed: bool) -> dict[str, dict[int, Series]]:
    """Rows of (key, time, then per field: value, or mean, min, max) in time order -> field -> key -> Series."""
    width = 3 if bucketed else 1
    times: dict[int, list[float]] = {}
    columns: dict[int, list[list]] = {}
    for row in rows:
        times.setdefault(row[0], []).append(row[1])
        lists = columns.setdefault(row[0], [[] for _ in range(width * len(fields))])
        for target, value in zip(lists, row[2:], strict=True):
            target.append(value)
    out: dict[str, dict[int, Series]] = {}
    for i, field in enumerate(fields):
        per_key = {}
        for key in sorted(times):
            v = columns[key][i * width : (i + 1) * width]
            per_key[key] = Series(times[key], v[0], v[1], v[2]) if bucketed else Series(times[key], v[0])
        out[field] = per_key
    return out
