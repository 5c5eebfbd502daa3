"""The record `redline monitor --record FILE` writes and `redline report FILE` reads: one SQLite file.

Its tables, columns and encoding are ``record_format``'s; the reads behind plots and summaries are
``record_query``'s.

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

import math
import os
import sqlite3
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from redline.errors import BadInput, RedlineError, one_line
from redline.files import open_regular
from redline.lockfile import WriterLock
from redline.monitor import record_query
from redline.monitor.record_format import (
    APPLICATION_ID,
    FORMAT_VERSION,
    GPU_FIELDS,
    GPU_TABLE,
    HOST_FIELDS,
    HOST_TABLE,
    ROLLUP_S,
    STEP_FIELDS,
    STEP_TABLE,
    TABLES,
    decode,
    encode,
    number,
    rollup_values,
)
from redline.monitor.record_query import GpuStats, Series, StepStats, window
from redline.monitor.sample import Sample

PRUNE_INTERVAL_S = 60.0
MAX_POWER_GAP_S = 60.0  # power x time is integrated only across gaps up to this (the monitor ran throughout)
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
_CHUNK = 512  # samples decoded per read transaction, so a long read never holds the WAL back


@dataclass
class _GpuLast:
    """A GPU's previous reading, for the energy it used since."""

    time: float
    energy_joules_total: float | None
    power_watts: float | None


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


def _check_header(path: Path) -> bool:
    """Refuse, from the file's first bytes alone, anything that is not a redline record; True when the file is
    absent or empty (a new record). SQLite never opens a refused file, so it cannot change a byte of it."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):  # the caller makes the folder, or says why it cannot
        return True
    except OSError as exc:
        raise BadInput(f"cannot read monitor record {path}: {exc.strerror or exc}") from None
    fd = open_regular(path, "monitor record")  # a folder, a FIFO or a device: refused, never opened blocking
    try:
        header, size = os.read(fd, _HEADER_BYTES), os.fstat(fd).st_size
    except OSError as exc:
        raise BadInput(f"cannot read monitor record {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
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
            for table in TABLES.values():
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
        wanted = {"samples", "notes"} | set(TABLES) | {t.rollup for t in TABLES.values()}
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
        sid = conn.execute("INSERT INTO samples (time, body) VALUES (?, ?)", (t, encode(sample))).lastrowid
        conn.executemany("INSERT INTO notes VALUES (?, ?, ?, ?)", [(t, sid, i, n) for i, n in enumerate(sample.notes)])
        bucket = math.floor(t / ROLLUP_S)
        gpu_rows = []
        for pos, g in enumerate(sample.gpus):
            now = _GpuLast(t, number(g.energy_joules_total), number(g.power_watts))
            values = [number(getattr(g, f)) for f in GPU_FIELDS] + [_energy_since(last_gpu.get(g.index), now)]
            last_gpu[g.index] = now
            gpu_rows.append(((t, sid, pos, g.index, *values), (bucket, g.index, t, *rollup_values(values))))
        step_rows = []
        for pos, s in enumerate(sample.steps):
            values = [number(getattr(s, f)) for f in STEP_FIELDS]
            step_rows.append(((t, sid, pos, s.rank, *values), (bucket, s.rank, t, *rollup_values(values))))
        host_rows = []
        if sample.host is not None:
            values = [number(getattr(sample.host, f)) for f in HOST_FIELDS]
            host_rows.append(((t, sid, *values), (bucket, t, *rollup_values(values))))
        for table, rows in ((GPU_TABLE, gpu_rows), (STEP_TABLE, step_rows), (HOST_TABLE, host_rows)):
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
                for table in TABLES.values():
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
        where, args = window(start, end)
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
        where, args = window(start, end)
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
                    yield decode(body)
                except (zlib.error, ValueError, TypeError, KeyError) as exc:
                    raise _corrupt(self.name, f"sample at {time}: {one_line(exc)}") from None
            if len(rows) < _CHUNK:
                return
            after = (rows[-1][0], rows[-1][1])

    def latest(self) -> Sample | None:
        """The newest sample, whole."""
        with self._reading() as conn:
            row = conn.execute("SELECT body FROM samples ORDER BY time DESC, id DESC LIMIT 1").fetchone()
        return None if row is None else decode(row[0])

    def notes(self, start: float | None = None, end: float | None = None) -> list[tuple[float, str]]:
        """(time, text) of every note in the range, oldest first: what the sampler could not read, and when. Kept
        in their own table because they are rare (given once per problem) and a report must not decode a day of
        samples to find them."""
        where, args = window(start, end)
        with self._reading() as conn:
            return conn.execute(f"SELECT time, text FROM notes {where} ORDER BY time, sample, pos", args).fetchall()

    def gpu_indices(self) -> list[int]:
        with self._reading() as conn:
            return [row[0] for row in conn.execute("SELECT DISTINCT gpu FROM gpu_rollup ORDER BY gpu")]

    def ranks(self) -> list[int]:
        with self._reading() as conn:
            return [row[0] for row in conn.execute("SELECT DISTINCT rank FROM step_rollup ORDER BY rank")]

    # -- reading lines for plots -----------------------------------------------------------------------------

    # -- reading lines for plots and summaries ------------------------------------------------------------

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
        """Several fields of one table ("gpu", "host" or "step") at once: field -> key -> Series, downsampled
        to ``max_points`` per line (how: ``record_query.series``)."""
        with self._reading() as conn:
            return record_query.series(conn, table, fields, key, start, end, max_points)

    def gpu_stats(self, start: float | None = None, end: float | None = None) -> dict[int, GpuStats]:
        """Per GPU: mean and p95 utilisation, peak memory, mean power, energy, hottest temperature."""
        with self._reading() as conn:
            return record_query.gpu_stats(conn, start, end)

    def step_stats(self, start: float | None = None, end: float | None = None) -> dict[int, StepStats]:
        """Per rank: how many steps, their mean time, mean data wait and its share of the step time."""
        with self._reading() as conn:
            return record_query.step_stats(conn, start, end)
