"""The record `redline monitor --record FILE` writes and `redline report FILE` reads: one SQLite file.

Layout, and why:

* ``samples(id, time, body)``: every ``Sample`` whole, as compact JSON compressed with zlib (2-4 KiB for an
  8-GPU sample instead of 11). The body is the record of truth: whatever the schema holds survives the round
  trip, including fields no plot uses yet.
* ``notes(time, text)``: ``Sample.notes``, which are rare (the sampler gives each problem once), so a report
  lists them without decoding every body.
* ``gpu``, ``host``, ``step``: narrow numeric tables (one row per GPU, per host, per training step of each
  sample) with the fields plots and summaries read, keyed by time first, so a time range is an index range
  scan of small rows and no JSON is decoded. Their columns are fixed lists (``GPU_FIELDS`` ...): a new Sample
  field lands in the body at once and in a column only when ``FORMAT_VERSION`` is raised. The GPU table also
  holds ``energy_joules``, the energy each GPU used since the previous sample (from the energy counter,
  else from power x time), so energy over any range is a plain sum.
* ``gpu_rollup``, ``host_rollup``, ``step_rollup``: per ``ROLLUP_S`` bucket and GPU/rank, the count, sum, min
  and max of every column, kept in the same transaction as the rows they summarise. A day at 1 Hz on 8 GPUs is
  700k GPU rows: SQLite aggregates them at about 1 us per row per column, so a report reading them raw would
  take many seconds; from the rollups it reads 70k. Plots over long ranges and the summaries use them;
  summaries read raw rows only at the two partial buckets at the ends of a range, so they stay exact.

One writer: ``Store.open`` holds ``FILE.lock`` (``redline.lockfile``) while it records; a second monitor
recording into the same file is refused with one line instead of interleaving its samples with the first's.

Durability: WAL journal with ``synchronous=NORMAL`` and one transaction per ``append``. A committed
transaction survives the writer being killed (kill -9, OOM killer): only the sample being written is lost.
(A power cut may also drop the last commits since the latest checkpoint, never corrupt the file.) Readers in
other processes see every committed sample while the writer runs, and never block it.

Safety: the file is recognised by SQLite's ``application_id`` header field before SQLite ever opens it, so a
foreign SQLite database, a non-SQLite file or a truncated record is refused with one line and left exactly
as it was; redline never overwrites or "repairs" a file it did not write.

Retention: samples older than ``retention_s`` before the newest one are deleted every ``PRUNE_INTERVAL_S`` of
sample time (not on every append: a delete costs a range scan), so the file holds at most
``retention_s + PRUNE_INTERVAL_S`` of samples. SQLite reuses the freed pages, so the file stops growing.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from redline.errors import BadInput, RedlineError
from redline.lockfile import WriterLock
from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample

# "RDLM" in SQLite's header: which application wrote the file (https://www.sqlite.org/fileformat.html)
APPLICATION_ID = 0x52444C4D
# the record format: tables, columns and body encoding; raise it (and read the old one) when any changes
FORMAT_VERSION = 1
ROLLUP_S = 10.0  # rollup bucket: 8,640 a day per GPU; ranges under ROLLUP_S x max_points are read raw
PRUNE_INTERVAL_S = 60.0
MAX_POWER_GAP_S = 60.0  # power x time is integrated only across gaps up to this (the monitor ran throughout)
P95_SAMPLE_LIMIT = 20_000  # p95 is exact up to this many samples, from an even subsample of them beyond
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
_CHUNK = 512  # samples decoded per read transaction, so a long read never holds the WAL back

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
STEP_FIELDS = (
    "step",
    "time_s",
    "data_s",
    "compute_s",
    "optimizer_s",
    "comm_s",
    "samples_per_s",
    "tokens_per_s",
    "mfu_catalog",
    "peak_memory_bytes",
    "loss",
)
ENERGY_FIELD = "energy_joules"  # derived, GPU table only: joules since this GPU's previous sample


@dataclass(frozen=True)
class _Table:
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


_GPU = _Table("gpu", "gpu", (*GPU_FIELDS, ENERGY_FIELD))
_HOST = _Table("host", None, HOST_FIELDS)
_STEP = _Table("step", "rank", STEP_FIELDS)
_TABLES = {t.name: t for t in (_GPU, _HOST, _STEP)}


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


@dataclass
class _GpuLast:
    """A GPU's previous reading, for the energy it used since."""

    time: float
    energy_joules_total: float | None
    power_watts: float | None


def _encode(sample: Sample) -> bytes:
    """The JSON of ``sample.to_dict()``, made by the C encoder reading each dataclass's ``__dict__``: the same
    text at a fifth of the cost (``asdict`` deep-copies every value), which is most of an append's time."""
    return zlib.compress(json.dumps(sample, default=vars, separators=(",", ":")).encode(), 1)


def _decode(body: bytes) -> Sample:
    return Sample.from_dict(json.loads(zlib.decompress(body)))


def _number(value: Any) -> float | int | None:
    """What a numeric column accepts: a bool as 0/1, a finite number, otherwise NULL (a gap)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


def _energy_since(last: _GpuLast | None, now: _GpuLast) -> float | None:
    """Joules a GPU used between two readings: the counter's increase (None across a reset, when the driver
    reloaded), else the trapezoid of power over a gap short enough that the monitor was watching."""
    if last is None or not now.time > last.time:
        return None
    if now.energy_joules_total is not None and last.energy_joules_total is not None:
        used = now.energy_joules_total - last.energy_joules_total
        return used if used >= 0 else None
    if now.power_watts is not None and last.power_watts is not None and now.time - last.time <= MAX_POWER_GAP_S:
        return (now.power_watts + last.power_watts) / 2 * (now.time - last.time)
    return None


def _rollup_values(values: Sequence[float | int | None]) -> list[float | int | None]:
    """n, sum, min, max of one value per field, as the rollup upsert takes them."""
    out: list[float | int | None] = []
    for v in values:
        out += [0, 0.0, None, None] if v is None else [1, v, v, v]
    return out


# -- the file's first bytes ----------------------------------------------------------------------------------


def _check_header(path: Path) -> bool:
    """Refuse, from the file's first bytes alone, anything that is not a redline record; True when the file is
    absent or empty (a new record). SQLite never opens a refused file, so it cannot change a byte of it."""
    try:
        if path.is_dir():
            raise BadInput(f"cannot use {path} as a monitor record: it is a directory")
        with path.open("rb") as fh:
            header = fh.read(_HEADER_BYTES)
        size = path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):  # the caller makes the folder, or says why it cannot
        return True
    except OSError as exc:
        raise BadInput(f"cannot read monitor record {path}: {exc.strerror or exc}") from None
    if not header:
        return True
    if not header.startswith(_SQLITE_MAGIC[: len(header)]):
        raise BadInput(f"{path} is not a redline monitor record (not an SQLite file); left untouched: use another path")
    if len(header) < _HEADER_BYTES:
        raise _corrupt(path, f"only {len(header)} bytes")
    if int.from_bytes(header[68:72], "big") != APPLICATION_ID:
        raise BadInput(f"{path} is an SQLite database of another application; left untouched: use another path")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # SQLite's own rule for trusting the page count; with a WAL beside the file, pages may still live there only
    header_size_valid = header[24:28] == header[92:96]
    if header_size_valid and not _has_wal(path) and size < pages * page_size:
        raise _corrupt(path, f"truncated: {size} bytes of {pages * page_size}")
    return False


def _make_folder(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = "a file is in the way" if isinstance(exc, FileExistsError | NotADirectoryError) else exc.strerror
        raise BadInput(f"cannot create the folder of monitor record {path}: {reason or exc}") from None


def _has_sidecars(path: Path) -> bool:
    """A -wal or -shm beside the record: a writer runs, or one was killed and left its last commits there."""
    return any(path.with_name(path.name + suffix).exists() for suffix in ("-wal", "-shm"))


def _has_wal(path: Path) -> bool:
    try:
        return path.with_name(path.name + "-wal").stat().st_size > 0
    except OSError:
        return False


def _hint(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "unable to open" in text or "readonly" in text:
        return " (check that the file and its folder are writable)"
    return ""


def _corrupt(path: Path | str, detail: str) -> BadInput:
    return BadInput(f"monitor record {path} is corrupt ({detail}); it was left as it is: record to a new path")


class Store:
    """A monitor record. ``Store.open`` to record (create or append), ``Store.read`` to look at one (no writes,
    safe while another process records into it), ``Store.from_samples`` for samples held in memory.

    One Store may be shared by threads (the sampler appends while an exporter reads): every statement runs
    under a lock.
    """

    def __init__(self, conn: sqlite3.Connection, name: str, retention_s: float | None, writable: bool) -> None:
        self._conn = conn
        self.name = name
        self.retention_s = retention_s
        self._writable = writable
        self._lock = threading.RLock()
        self._last_prune: float | None = None
        self._last_gpu: dict[int, _GpuLast] = {}
        self._closed = False
        self._writer_lock: WriterLock | None = None  # held by a Store that records into a file

    # -- opening ---------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], retention_s: float | None = None) -> Store:
        """Create the record at ``path`` (and its folder), or append to it when it is already one.
        ``retention_s`` keeps only that much history before the newest sample (None keeps everything)."""
        if retention_s is not None and not retention_s > 0:
            raise BadInput(f"retention must be a positive number of seconds, not {retention_s}")
        path = Path(path)
        new = _check_header(path)
        _make_folder(path)
        # two monitors appending to one file would interleave their samples, and every report would mix them
        lock = WriterLock(path, what="monitor record").acquire()
        try:
            store = cls(cls._connect(path), str(path), retention_s, writable=True)
        except BaseException:
            lock.release()
            raise
        store._writer_lock = lock
        with store._closing_on_error("record into"):
            if new:
                store._create()
            store._validate(deep=True)
            store._conn.execute("PRAGMA journal_mode=WAL")
            store._conn.execute("PRAGMA synchronous=NORMAL")
            store._write_probe()
            store._resume()
            store.prune()
        return store

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Store:
        """An existing record, for reading only: never created, never written, never pruned, never folded.

        A read-write connection would fold the WAL into the file when it closes (the last connection to a WAL
        database checkpoints), so a report would change the record it reads. Readers therefore open it with
        ``mode=ro``, which sees what a running (or killed) writer left in the WAL and writes nothing back; a
        record closed cleanly, with no WAL and no writer, is read ``immutable`` so that no -wal/-shm file is
        even created beside it.
        """
        path = Path(path)
        if _check_header(path):
            raise BadInput(f"no monitor record at {path}" + (" (the file is empty)" if path.exists() else ""))
        settled = not _has_sidecars(path) and not WriterLock(path).path.exists()
        try:
            store = cls(cls._connect(path, mode="immutable" if settled else "ro"), str(path), None, writable=False)
            with store._closing_on_error("read"):
                store._validate(deep=False)
        except BadInput as exc:
            if "unable to open" not in str(exc) or settled:
                raise
            # a record in a folder we may not write (a read-only mount, someone else's): SQLite cannot make the
            # WAL index beside it, so read the file as it stands (what a writer left in its WAL is not seen)
            store = cls(cls._connect(path, mode="immutable"), str(path), None, writable=False)
            with store._closing_on_error("read"):
                store._validate(deep=False)
        return store

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> Store:
        """An in-memory store of ``samples``, so a report of samples held in memory takes the same path as one
        of a file."""
        store = cls(sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False), "<memory>", None, True)
        store._create()
        store.append_many(samples)
        return store

    @staticmethod
    def _connect(path: Path, mode: str = "rw") -> sqlite3.Connection:
        """``mode``: "rw" (create or append), "ro" (read, see the WAL, write nothing), "immutable" (read the file
        alone: no locks, no WAL, nothing created beside it)."""
        query = {"rw": "", "ro": "?mode=ro", "immutable": "?immutable=1"}[mode]
        target = f"{path.resolve().as_uri()}{query}" if query else str(path)
        try:
            # autocommit: transactions are explicit (BEGIN IMMEDIATE), so each one is exactly what we decide
            return sqlite3.connect(target, isolation_level=None, check_same_thread=False, timeout=10.0, uri=bool(query))
        except sqlite3.Error as exc:
            raise BadInput(f"cannot open monitor record {path}: {exc}{_hint(exc)}") from None

    @contextmanager
    def _closing_on_error(self, doing: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.DatabaseError as exc:
            self._close_connection()
            raise self._error(exc, doing, BadInput) from None
        except BaseException:
            self._close_connection()
            raise

    def _close_connection(self) -> None:
        self._conn.close()
        if self._writer_lock is not None:
            self._writer_lock.release()

    def _create(self) -> None:
        # one transaction, in rollback-journal mode before WAL is switched on: the header then carries the
        # application id in the main file from the first byte written, and a crash here leaves an empty file
        with self._transaction() as conn:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
            conn.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, time REAL NOT NULL, body BLOB NOT NULL)")
            conn.execute("CREATE INDEX samples_time ON samples (time)")
            conn.execute(
                "CREATE TABLE notes (time REAL NOT NULL, sample INTEGER NOT NULL, pos INTEGER NOT NULL,"
                " text TEXT NOT NULL, PRIMARY KEY (time, sample, pos)) WITHOUT ROWID"
            )
            for table in _TABLES.values():
                for statement in table.create_sql():
                    conn.execute(statement)

    def _validate(self, deep: bool) -> None:
        """The file is a record this version reads. ``deep`` also reads every page (quick_check, ~0.1 s per
        100 MB): done before recording into a file, so a damaged one is refused at the start, not mid-run."""
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > FORMAT_VERSION:
            raise BadInput(
                f"monitor record {self.name} has format {version}, newer than this redline reads ({FORMAT_VERSION}):"
                " upgrade redline, or record to a new path"
            )
        tables = {row[0] for row in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        wanted = {"samples", "notes"} | set(_TABLES) | {t.rollup for t in _TABLES.values()}
        missing = sorted(wanted - tables)
        if version != FORMAT_VERSION or missing:
            raise _corrupt(self.name, f"format {version}, missing tables {', '.join(missing) or 'none'}")
        if deep:
            problems = [row[0] for row in self._conn.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                raise _corrupt(self.name, "; ".join(problems)[:300])

    def _write_probe(self) -> None:
        """Take the write lock once, so a read-only file or folder is reported now, not at the first sample."""
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.execute("COMMIT")

    def _resume(self) -> None:
        """Appending to an existing record: the energy of the first new sample counts from the last old one."""
        last = self.latest()
        if last is not None:
            self._last_gpu = {g.index: _GpuLast(last.time, g.energy_joules_total, g.power_watts) for g in last.gpus}

    # -- errors and transactions -----------------------------------------------------------------------------

    def _error(self, exc: sqlite3.DatabaseError, doing: str, kind: type[RedlineError] = RedlineError) -> RedlineError:
        """One line the user can act on, for an SQLite error: a damaged file is always bad input; anything else
        is bad input while opening (the path was wrong), a plain error mid-run (the disk filled up)."""
        text = str(exc)
        if type(exc) is sqlite3.DatabaseError or "malformed" in text:  # "not a database", "disk image is malformed"
            return _corrupt(self.name, text)
        return kind(f"cannot {doing} monitor record {self.name}: {text}{_hint(exc)}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                if self._conn.in_transaction:  # SQLite has already rolled back after some errors (disk full)
                    self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.DatabaseError as exc:
                raise self._error(exc, "read") from None

    # -- writing ---------------------------------------------------------------------------------------------

    def append(self, sample: Sample) -> None:
        """Keep one sample, committed before this returns."""
        self.append_many([sample])

    def append_many(self, samples: Iterable[Sample]) -> int:
        """Keep samples in one transaction (an import, a test): all or none. Returns how many."""
        if not self._writable:
            raise RedlineError(f"monitor record {self.name} was opened for reading")
        n = 0
        newest = None
        last_gpu = dict(self._last_gpu)  # committed with the samples, or not at all
        try:
            with self._transaction() as conn:
                for sample in samples:
                    self._insert(conn, sample, last_gpu)
                    newest = sample.time if newest is None else max(newest, sample.time)
                    n += 1
        except sqlite3.DatabaseError as exc:
            raise self._error(exc, "write to") from None
        self._last_gpu = last_gpu
        if newest is not None and self._prune_due(newest):
            self.prune()
        return n

    @staticmethod
    def _insert(conn: sqlite3.Connection, sample: Sample, last_gpu: dict[int, _GpuLast]) -> None:
        t = float(sample.time)
        sid = conn.execute("INSERT INTO samples (time, body) VALUES (?, ?)", (t, _encode(sample))).lastrowid
        conn.executemany("INSERT INTO notes VALUES (?, ?, ?, ?)", [(t, sid, i, n) for i, n in enumerate(sample.notes)])
        bucket = math.floor(t / ROLLUP_S)
        gpu_rows = []
        for pos, g in enumerate(sample.gpus):
            now = _GpuLast(t, _number(g.energy_joules_total), _number(g.power_watts))
            values = [_number(getattr(g, f)) for f in GPU_FIELDS] + [_energy_since(last_gpu.get(g.index), now)]
            last_gpu[g.index] = now
            gpu_rows.append(((t, sid, pos, g.index, *values), (bucket, g.index, t, *_rollup_values(values))))
        step_rows = []
        for pos, s in enumerate(sample.steps):
            values = [_number(getattr(s, f)) for f in STEP_FIELDS]
            step_rows.append(((t, sid, pos, s.rank, *values), (bucket, s.rank, t, *_rollup_values(values))))
        host_rows = []
        if sample.host is not None:
            values = [_number(getattr(sample.host, f)) for f in HOST_FIELDS]
            host_rows.append(((t, sid, *values), (bucket, t, *_rollup_values(values))))
        for table, rows in ((_GPU, gpu_rows), (_STEP, step_rows), (_HOST, host_rows)):
            if rows:
                conn.executemany(table.insert_sql, [row for row, _ in rows])
                conn.executemany(table.upsert_sql, [rollup for _, rollup in rows])

    def _prune_due(self, newest: float) -> bool:
        if self.retention_s is None:
            return False
        return self._last_prune is None or newest - self._last_prune >= min(PRUNE_INTERVAL_S, self.retention_s)

    def prune(self) -> int:
        """Apply retention now: delete samples older than ``retention_s`` before the newest. Returns how many."""
        if self.retention_s is None or not self._writable:
            return 0
        try:
            with self._transaction() as conn:
                newest = conn.execute("SELECT MAX(time) FROM samples").fetchone()[0]
                if newest is None:
                    return 0
                cutoff = newest - self.retention_s
                deleted = conn.execute("DELETE FROM samples WHERE time < ?", (cutoff,)).rowcount
                conn.execute("DELETE FROM notes WHERE time < ?", (cutoff,))
                for table in _TABLES.values():
                    conn.execute(f"DELETE FROM {table.name} WHERE time < ?", (cutoff,))
                    # buckets wholly before the cutoff; the one it falls in stays, summarising a few pruned rows
                    conn.execute(f"DELETE FROM {table.rollup} WHERE bucket < ?", (math.floor(cutoff / ROLLUP_S),))
        except sqlite3.DatabaseError as exc:
            raise self._error(exc, "prune") from None
        self._last_prune = newest
        return deleted

    def close(self) -> None:
        """Prune once more, then close (SQLite then folds the WAL back into the file)."""
        with self._lock:
            if self._closed:
                return
            try:
                self.prune()
            finally:
                self._closed = True
                self._close_connection()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading samples -------------------------------------------------------------------------------------

    def count(self, start: float | None = None, end: float | None = None) -> int:
        where, args = _window(start, end)
        with self._reading() as conn:
            return conn.execute(f"SELECT COUNT(*) FROM samples {where}", args).fetchone()[0]

    def time_range(self) -> tuple[float, float] | None:
        """(oldest, newest) sample time, or None for an empty record."""
        with self._reading() as conn:
            first, last = conn.execute("SELECT MIN(time), MAX(time) FROM samples").fetchone()
        return None if first is None else (first, last)

    def samples(self, start: float | None = None, end: float | None = None) -> Iterator[Sample]:
        """Samples with ``start <= time <= end``, oldest first, decoded a chunk at a time: each chunk is its own
        short read, so iterating a day-long record neither holds all of it in memory nor stalls the writer."""
        where, args = _window(start, end)
        after = (-math.inf, -1)
        keyset = "(time, id) > (?, ?)"
        clause = f"{where} AND {keyset}" if where else f"WHERE {keyset}"
        while True:
            with self._reading() as conn:
                rows = conn.execute(
                    f"SELECT time, id, body FROM samples {clause} ORDER BY time, id LIMIT {_CHUNK}", (*args, *after)
                ).fetchall()
            for time, _, body in rows:
                try:
                    yield _decode(body)
                except (zlib.error, ValueError, TypeError, KeyError) as exc:
                    raise _corrupt(self.name, f"sample at {time}: {type(exc).__name__}: {exc}") from None
            if len(rows) < _CHUNK:
                return
            after = (rows[-1][0], rows[-1][1])

    def latest(self) -> Sample | None:
        """The newest sample, whole."""
        with self._reading() as conn:
            row = conn.execute("SELECT body FROM samples ORDER BY time DESC, id DESC LIMIT 1").fetchone()
        return None if row is None else _decode(row[0])

    def notes(self, start: float | None = None, end: float | None = None) -> list[tuple[float, str]]:
        """(time, text) of every note in the range, oldest first: what the sampler could not read, and when. Kept
        in their own table because they are rare (given once per problem) and a report must not decode a day of
        samples to find them."""
        where, args = _window(start, end)
        with self._reading() as conn:
            return conn.execute(f"SELECT time, text FROM notes {where} ORDER BY time, sample, pos", args).fetchall()

    def gpu_indices(self) -> list[int]:
        with self._reading() as conn:
            return [row[0] for row in conn.execute("SELECT DISTINCT gpu FROM gpu_rollup ORDER BY gpu")]

    def ranks(self) -> list[int]:
        with self._reading() as conn:
            return [row[0] for row in conn.execute("SELECT DISTINCT rank FROM step_rollup ORDER BY rank")]

    # -- reading lines for plots -----------------------------------------------------------------------------

    def gpu_series(
        self,
        field: str,
        gpu: int | None = None,
        start: float | None = None,
        end: float | None = None,
        max_points: int | None = None,
    ) -> dict[int, Series]:
        """``field`` (one of ``GPU_FIELDS`` or ``energy_joules``) over time, per GPU index (only ``gpu`` when
        given)."""
        return self.series("gpu", [field], gpu, start, end, max_points)[field]

    def host_series(
        self, field: str, start: float | None = None, end: float | None = None, max_points: int | None = None
    ) -> Series:
        """``field`` (one of ``HOST_FIELDS``) over time; empty when no sample had host data."""
        return self.series("host", [field], None, start, end, max_points)[field].get(0, Series([], []))

    def step_series(
        self,
        field: str,
        rank: int | None = None,
        start: float | None = None,
        end: float | None = None,
        max_points: int | None = None,
    ) -> dict[int, Series]:
        """``field`` (one of ``STEP_FIELDS``) of the training steps, per rank, at the time of the sample that
        carried each step."""
        return self.series("step", [field], rank, start, end, max_points)[field]

    def series(
        self,
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
        spec = _TABLES.get(table)
        if spec is None:
            raise ValueError(f"no table {table!r}; the tables are: {', '.join(_TABLES)}")
        for field in fields:
            spec.check(field)
        with self._reading() as conn:
            span = self._span(conn, spec, start, end, key)
            if span is None:
                return {f: {} for f in fields}
            t0, t1 = span
            if not max_points or t1 <= t0 or self._most_rows(conn, spec, t0, t1, key) <= max_points:
                return self._raw(conn, spec, fields, t0, t1, key)
            width = (t1 - t0) / max(1, max_points - 1)
            if width >= ROLLUP_S:
                return self._bucketed_rollup(conn, spec, fields, t0, t1, key, width)
            return self._bucketed_raw(conn, spec, fields, t0, t1, key, width)

    @staticmethod
    def _key_filter(spec: _Table, key: int | None) -> tuple[str, tuple[int, ...]]:
        return (f" AND {spec.key} = ?", (key,)) if key is not None and spec.key else ("", ())

    def _span(
        self, conn: sqlite3.Connection, spec: _Table, start: float | None, end: float | None, key: int | None
    ) -> tuple[float, float] | None:
        """First and last row time in the range (two index probes, not a scan)."""
        lo = -math.inf if start is None else float(start)
        hi = math.inf if end is None else float(end)
        key_sql, key_args = self._key_filter(spec, key)
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

    def _most_rows(self, conn: sqlite3.Connection, spec: _Table, t0: float, t1: float, key: int | None) -> int:
        """Rows of the longest line in the range, from the rollup (whole buckets: close enough to choose)."""
        key_sql, key_args = self._key_filter(spec, key)
        group = f"GROUP BY {spec.key}" if spec.key else ""
        row = conn.execute(
            f"SELECT MAX(n) FROM (SELECT SUM(n) AS n FROM {spec.rollup} WHERE bucket BETWEEN ? AND ?{key_sql} {group})",
            (math.floor(t0 / ROLLUP_S), math.floor(t1 / ROLLUP_S), *key_args),
        ).fetchone()
        return row[0] or 0

    def _raw(
        self, conn: sqlite3.Connection, spec: _Table, fields: Sequence[str], t0: float, t1: float, key: int | None
    ) -> dict[str, dict[int, Series]]:
        key_sql, key_args = self._key_filter(spec, key)
        rows = conn.execute(
            f"SELECT {spec.key_expr}, time, {', '.join(fields)} FROM {spec.name}"
            f" WHERE time >= ? AND time <= ?{key_sql} ORDER BY time",
            (t0, t1, *key_args),
        )
        return _split(rows, fields, bucketed=False)

    def _bucketed_raw(
        self,
        conn: sqlite3.Connection,
        spec: _Table,
        fields: Sequence[str],
        t0: float,
        t1: float,
        key: int | None,
        width: float,
    ) -> dict[str, dict[int, Series]]:
        key_sql, key_args = self._key_filter(spec, key)
        aggregates = ", ".join(f"AVG({f}), MIN({f}), MAX({f})" for f in fields)
        group = f"{spec.key + ', ' if spec.key else ''}CAST((time - ?) / ? AS INTEGER)"
        rows = conn.execute(
            f"SELECT {spec.key_expr}, AVG(time), {aggregates} FROM {spec.name}"
            f" WHERE time >= ? AND time <= ?{key_sql} GROUP BY {group} ORDER BY 2",
            (t0, t1, *key_args, t0, width),
        )
        return _split(rows, fields, bucketed=True)

    def _bucketed_rollup(
        self,
        conn: sqlite3.Connection,
        spec: _Table,
        fields: Sequence[str],
        t0: float,
        t1: float,
        key: int | None,
        width: float,
    ) -> dict[str, dict[int, Series]]:
        """Buckets of ``width`` seconds made of whole rollup buckets (``width >= ROLLUP_S``): the ends of the range
        are rounded out to whole rollup buckets, which a plot cannot show."""
        key_sql, key_args = self._key_filter(spec, key)
        aggregates = ", ".join(f"SUM({f}_sum) / NULLIF(SUM({f}_n), 0), MIN({f}_min), MAX({f}_max)" for f in fields)
        group = f"{spec.key + ', ' if spec.key else ''}CAST(((bucket + 0.5) * ? - ?) / ? AS INTEGER)"
        rows = conn.execute(
            f"SELECT {spec.key_expr}, SUM(t_sum) / SUM(n), {aggregates} FROM {spec.rollup}"
            f" WHERE bucket BETWEEN ? AND ?{key_sql} GROUP BY {group} ORDER BY 2",
            (math.floor(t0 / ROLLUP_S), math.floor(t1 / ROLLUP_S), *key_args, ROLLUP_S, t0, width),
        )
        return _split(rows, fields, bucketed=True)

    # -- summaries -------------------------------------------------------------------------------------------

    def gpu_stats(self, start: float | None = None, end: float | None = None) -> dict[int, GpuStats]:
        """Per GPU: mean and p95 utilisation, peak memory, mean power, energy, hottest temperature."""
        wanted = [
            ("mean", "utilization_ratio"),
            ("max", "memory_used_bytes"),
            ("max", "memory_total_bytes"),
            ("mean", "power_watts"),
            ("sum", ENERGY_FIELD),
            ("max", "temperature_celsius"),
        ]
        with self._reading() as conn:
            summary = self._summary(conn, _GPU, wanted, start, end)
            p95 = self._p95(conn, "utilization_ratio", start, end)
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

    def step_stats(self, start: float | None = None, end: float | None = None) -> dict[int, StepStats]:
        """Per rank: how many steps, their mean time, mean data wait and its share of the step time."""
        wanted = [("mean", "time_s"), ("mean", "data_s"), ("sum", "time_s"), ("sum", "data_s")]
        with self._reading() as conn:
            summary = self._summary(conn, _STEP, wanted, start, end)
        return {
            rank: StepStats(rank, n, t, d, d_sum / t_sum if d_sum is not None and t_sum else None)
            for rank, (n, t, d, t_sum, d_sum) in summary.items()
        }

    def _summary(
        self,
        conn: sqlite3.Connection,
        spec: _Table,
        wanted: Sequence[tuple[str, str]],
        start: float | None,
        end: float | None,
    ) -> dict[int, tuple]:
        """key -> (rows, then each (kind, field) of ``wanted``: mean, max or sum over the range, None where the
        field was never known). Exact: whole rollup buckets inside the range, raw rows at its two ragged ends,
        combined as partial sums (count, sum, min, max) before the final aggregate."""
        span = self._span(conn, spec, start, end, None)
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

    def _p95(self, conn: sqlite3.Connection, field: str, start: float | None, end: float | None) -> dict[int, float]:
        """Nearest-rank 95th percentile per GPU: exact up to ``P95_SAMPLE_LIMIT`` samples, else of every k-th
        sample (sample ids run in time order, so the subsample is even over the range)."""
        where, args = _window(start, end)
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


def _window(start: float | None, end: float | None) -> tuple[str, tuple[float, ...]]:
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


def _check_fields() -> None:
    """The column lists name real Sample fields (checked at import: a renamed field fails loudly, at once)."""
    for cls, names in ((GpuSample, GPU_FIELDS), (HostSample, HOST_FIELDS), (StepSample, STEP_FIELDS)):
        unknown = set(names) - {f.name for f in fields(cls)}
        if unknown:
            raise RuntimeError(f"store columns not in {cls.__name__}: {sorted(unknown)}")


_check_fields()
