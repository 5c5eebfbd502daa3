"""The monitor record's format: its tables, their columns, and how a sample's body is encoded.

Layout, and why:

* ``samples(id, time, body)``: every ``Sample`` whole, as compact JSON compressed with zlib (2-4 KiB for an
  8-GPU sample instead of 11). The body is the record of truth: whatever the schema holds survives the round
  trip, including fields no plot uses yet.
* ``notes(time, text)``: ``Sample.notes``, which are rare (the sampler gives each problem once), so a report
  lists them without decoding every body.
* ``gpu``, ``host``, ``step``: narrow numeric tables (one row per GPU, per host, per training step of each
  sample) with the fields plots and summaries read, keyed by time first, so a time range is an index range
  scan of small rows and no JSON is decoded. Their columns are ``GPU_FIELDS``, ``HOST_FIELDS`` (chosen lists)
  and ``STEP_FIELDS`` (every field of ``StepSample``, the one schema of a step): a new GPU or host field lands
  in the body at once and in a column only when ``FORMAT_VERSION`` is raised; a new step field changes the
  step table, so it raises ``FORMAT_VERSION`` too (tests/monitor/test_store.py pins the columns of each).
  The GPU table also holds ``energy_joules``, the energy each GPU used since the previous sample (from the
  energy counter, else from power x time), so energy over any range is a plain sum.
* ``gpu_rollup``, ``host_rollup``, ``step_rollup``: per ``ROLLUP_S`` bucket and GPU/rank, the count, sum, min
  and max of every column, kept in the same transaction as the rows they summarise. A day at 1 Hz on 8 GPUs is
  700k GPU rows: SQLite aggregates them at about 1 us per row per column, so a report reading them raw would
  take many seconds; from the rollups it reads 70k. Plots over long ranges and the summaries use them;
  summaries read raw rows only at the two partial buckets at the ends of a range, so they stay exact.

Raise ``FORMAT_VERSION`` (and read the old one) when any of this changes.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample

# "RDLM" in SQLite's header: which application wrote the file (https://www.sqlite.org/fileformat.html)
APPLICATION_ID = 0x52444C4D
# the record format: tables, columns and body encoding; raise it (and read the old one) when any changes
FORMAT_VERSION = 1
ROLLUP_S = 10.0  # rollup bucket: 8,640 a day per GPU; ranges under ROLLUP_S x max_points are read raw

GPU_FIELDS = (
    "lost",
    "utilization_ratio",
    "memory_bandwidth_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "sm_clock_hertz",
    "sm_clock_max_hertz",
    "memory_clock_hertz",
    "power_watts",
    "power_limit_watts",
    "energy_joules_total",
    "temperature_celsius",
    "temperature_slowdown_celsius",
    "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second",
    "nvlink_tx_bytes_per_second",
    "nvlink_rx_bytes_per_second",
    "sm_activity_ratio",
    "tensor_activity_ratio",
)
HOST_FIELDS = (
    "cpu_ratio",
    "cpu_iowait_ratio",
    "load_1m",
    "memory_used_bytes",
    "memory_total_bytes",
    "swap_used_bytes",
    "disk_read_bytes_per_second",
    "disk_write_bytes_per_second",
    "network_rx_bytes_per_second",
    "network_tx_bytes_per_second",
)
# a step's every field but its rank (the table's key) is a column: the runtime's step record is the one schema
STEP_FIELDS = tuple(f.name for f in fields(StepSample) if f.name != "rank")
ENERGY_FIELD = "energy_joules"  # derived, GPU table only: joules since this GPU's previous sample


@dataclass(frozen=True)
class Table:
    """A narrow table and its rollup: ``key`` names the column that splits it into lines (GPU index, rank)."""

    name: str
    key: str | None
    fields: tuple[str, ...]

    def check(self, field: str) -> None:
        if field not in self.fields:
            raise ValueError(f"{self.name} has no column {field!r}; it has: {', '.join(self.fields)}")

    @property
    def rollup(self) -> str:
        return f"{self.name}_rollup"

    @property
    def key_expr(self) -> str:
        return self.key or "0"  # the host table is one line: key 0

    def create_sql(self) -> list[str]:
        key = f"{self.key} INTEGER NOT NULL, " if self.key else ""
        pos = "pos INTEGER NOT NULL, " if self.key else ""
        cols = ", ".join(f"{f} NUMERIC" for f in self.fields)
        rollup_cols = ", ".join(f"{f}_n INTEGER, {f}_sum REAL, {f}_min NUMERIC, {f}_max NUMERIC" for f in self.fields)
        rollup_key = f"bucket, {self.key}" if self.key else "bucket"
        return [
            f"CREATE TABLE {self.name} (time REAL NOT NULL, sample INTEGER NOT NULL, {pos}{key}{cols},"
            f" PRIMARY KEY (time, sample{', pos' if self.key else ''})) WITHOUT ROWID",
            f"CREATE TABLE {self.rollup} (bucket INTEGER NOT NULL, {key}n INTEGER NOT NULL, t_sum REAL NOT NULL,"
            f" {rollup_cols}, PRIMARY KEY ({rollup_key})) WITHOUT ROWID",
        ]

    @cached_property
    def insert_sql(self) -> str:
        columns = ["time", "sample", *(["pos", self.key] if self.key else []), *self.fields]
        return f"INSERT INTO {self.name} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"

    @cached_property
    def upsert_sql(self) -> str:
        """Add one row to its bucket: (bucket, [key,] time, then per field n, sum, min, max)."""
        per_field = [f"{f}_{part}" for f in self.fields for part in ("n", "sum", "min", "max")]
        columns = ["bucket", *([self.key] if self.key else []), "n", "t_sum", *per_field]
        merge = ["n = n + 1", "t_sum = t_sum + excluded.t_sum"]
        for f in self.fields:
            merge += [f"{f}_n = {f}_n + excluded.{f}_n", f"{f}_sum = {f}_sum + excluded.{f}_sum"]
            for m in ("min", "max"):  # scalar MIN/MAX are NULL when either side is: keep whichever is known
                merge.append(f"{f}_{m} = COALESCE({m.upper()}({f}_{m}, excluded.{f}_{m}), {f}_{m}, excluded.{f}_{m})")
        values = ", ".join("1" if c == "n" else "?" for c in columns)
        target = f"bucket, {self.key}" if self.key else "bucket"
        return (
            f"INSERT INTO {self.rollup} ({', '.join(columns)}) VALUES ({values})"
            f" ON CONFLICT ({target}) DO UPDATE SET {', '.join(merge)}"
        )


GPU_TABLE = Table("gpu", "gpu", (*GPU_FIELDS, ENERGY_FIELD))
HOST_TABLE = Table("host", None, HOST_FIELDS)
STEP_TABLE = Table("step", "rank", STEP_FIELDS)
TABLES = {t.name: t for t in (GPU_TABLE, HOST_TABLE, STEP_TABLE)}


def encode(sample: Sample) -> bytes:
    """The JSON of ``sample.to_dict()``, made by the C encoder reading each dataclass's ``__dict__``: the same
    text at a fifth of the cost (``asdict`` deep-copies every value), which is most of an append's time."""
    return zlib.compress(json.dumps(sample, default=vars, separators=(",", ":")).encode(), 1)


def decode(body: bytes) -> Sample:
    return Sample.from_dict(json.loads(zlib.decompress(body)))


def number(value: Any) -> float | int | None:
    """What a numeric column accepts: a bool as 0/1, a finite number, otherwise NULL (a gap)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


def rollup_values(values: Sequence[float | int | None]) -> list[float | int | None]:
    """n, sum, min, max of one value per field, as the rollup upsert takes them."""
    out: list[float | int | None] = []
    for v in values:
        out += [0, 0.0, None, None] if v is None else [1, v, v, v]
    return out


# -- the file's first bytes ----------------------------------------------------------------------------------


def _check_fields() -> None:
    """The column lists name real Sample fields (checked at import: a renamed field fails loudly, at once)."""
    for cls, names in ((GpuSample, GPU_FIELDS), (HostSample, HOST_FIELDS)):
        unknown = set(names) - {f.name for f in fields(cls)}
        if unknown:
            raise RuntimeError(f"record columns not in {cls.__name__}: {sorted(unknown)}")


_check_fields()
