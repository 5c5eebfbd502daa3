"""The queue's state: one SQLite database in WAL mode under the queue's directory.

Every change of a job is one committed transaction, so a daemon killed with -9 at any instant leaves each job
in a state the next daemon can act on (``daemon.Daemon.recover``). WAL lets `redline jobs` read while the
daemon writes; ``synchronous=NORMAL`` survives a process crash (not a power cut, which a reboot's recovery
handles as jobs lost).

States (``spec.JobState``): queued -> (held <-> queued) -> starting -> running -> done | failed | cancelled |
lost; a job that may retry goes back to queued with ``not_before`` (its backoff). "starting" is the moment
between the daemon's decision and the job's shim having started: see ``daemon.Daemon._launch``.

The database holds every job's environment: it is the daemon's alone (0600, in a private folder; layout.py).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redline.queue.spec import LIVE, STATES, JobSpec, JobState

__all__ = ["LIVE", "STATES", "Job", "Store"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uid INTEGER NOT NULL,
    user TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    attempt INTEGER NOT NULL DEFAULT 0,
    retries_left INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0,
    exit_code INTEGER,
    placement TEXT,
    share_logs INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
"""


@dataclass(frozen=True)
class Job:
    id: int
    uid: int
    user: str
    spec: JobSpec
    state: JobState
    reason: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    attempt: int
    retries_left: int
    not_before: float
    exit_code: int | None
    placement: dict[str, Any] | None  # {"uuids": [...], "reserved_bytes": [...]}
    share_logs: bool

    @property
    def key(self) -> str:
        return str(self.id)

    def to_dict(self, *, private: bool) -> dict[str, Any]:
        """As `redline jobs --json` shows it; the environment only to its owner and root (it may hold secrets)."""
        spec = self.spec.to_dict()
        if not private:
            spec["env"] = {}
        return {
            "id": self.id,
            "user": self.user,
            "uid": self.uid,
            "name": self.spec.label,
            "state": self.state,
            "reason": self.reason,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "attempt": self.attempt,
            "retries_left": self.retries_left,
            "exit_code": self.exit_code,
            "placement": self.placement,
            "spec": spec,
        }


class Store:
    def __init__(self, path: Path, *, threads: bool = False) -> None:
        """``threads``: the connection may be used from threads other than its maker's (one at a time)."""
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=not threads)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def add(self, spec: JobSpec, uid: int, user: str, *, held: bool = False, share: bool = False) -> Job:
        cursor = self.db.execute(
            "INSERT INTO jobs (uid, user, spec, state, reason, submitted_at, retries_left, share_logs) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (
                uid,
                user,
                json.dumps(spec.to_dict()),
                *((JobState.HELD, "held") if held else (JobState.QUEUED, "")),
                time.time(),
                spec.retries,
                share,
            ),
        )
        job = self.get(int(cursor.lastrowid or 0))
        assert job is not None
        return job

    def get(self, job_id: int) -> Job | None:
        if not 0 < job_id < 2**63:  # SQLite's integers: a larger id is no job's (and would not bind)
            return None
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def jobs(self, states: Sequence[str] | None = None, *, limit: int | None = None) -> list[Job]:
        """Jobs in ``states`` (all without), oldest first; ``limit``: the newest that many."""
        query, args = "SELECT * FROM jobs", []
        if states:
            query += f" WHERE state IN ({','.join('?' * len(states))})"
            args = list(states)
        if limit is not None:
            query = f"SELECT * FROM ({query} ORDER BY id DESC LIMIT {int(limit)})"
        return [_job(row) for row in self.db.execute(query + " ORDER BY id", args)]

    def update(self, job_id: int, **fields: Any) -> None:
        """One committed change of a job's fields (``placement`` a mapping, stored as JSON)."""
        if "placement" in fields and fields["placement"] is not None:
            fields["placement"] = json.dumps(fields["placement"])
        columns = ", ".join(f"{name} = ?" for name in fields)
        self.db.execute(f"UPDATE jobs SET {columns} WHERE id = ?", [*fields.values(), job_id])

    def counts(self) -> dict[str, int]:
        return {row[0]: row[1] for row in self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state")}

    def __iter__(self) -> Iterator[Job]:
        return iter(self.jobs())


def _job(row: sqlite3.Row) -> Job:
    return Job(
        id=row["id"],
        uid=row["uid"],
        user=row["user"],
        spec=JobSpec.from_dict(json.loads(row["spec"])),
        state=JobState(row["state"]),
        reason=row["reason"],
        submitted_at=row["submitted_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        attempt=row["attempt"],
        retries_left=row["retries_left"],
        not_before=row["not_before"],
        exit_code=row["exit_code"],
        placement=json.loads(row["placement"]) if row["placement"] else None,
        share_logs=bool(row["share_logs"]),
    )
