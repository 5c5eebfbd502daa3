"""The queue's folder, private by construction.

    DIR/                   0711 when root's (users reach the socket, list nothing), else 0700
      queue.sock           0666 when root's (the peer's uid decides what it may do), else 0600
      queue.db, -wal, -shm 0600: every job's spec, environments included
      daemon.lock, daemon.log, metrics.port                             0600
      jobs/<id>/           0700
        output.log         the job's user's, 0600 (0644 with --share-logs); read through the daemon
        <attempt>/         0700: run.json (argv, environment), lock, pid.json, exit.json, shim.log: 0600
      spool/               0711 when root's
        <id>.<attempt>/    the job's user's, 0700: where its runtime leaves records (out of memory)

The daemon runs with umask 077, so whatever it makes is private unless it says otherwise; at start it brings an
older folder to these modes (``make_private``) and says once what it changed. The only paths it opens that a
user controls are the spool's records, and those through ``redline.files.open_regular`` (no symlink, no FIFO,
the job's user's own file, size-capped).
"""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

from redline import files
from redline.units import MiB

MIN_FREE_BYTES = 8 * MiB  # below this a submit is refused: what a job's start writes, with room to spare
RECORD_LIMIT_BYTES = 64 * 1024  # an out-of-memory record is a line of JSON


def shared() -> bool:
    """Whether this daemon serves the machine (root's) rather than one user."""
    return os.geteuid() == 0


def folder_mode(path: Path, directory: Path) -> int:
    """The mode a folder of the queue's own should have."""
    reachable = path in (directory, directory / "spool")
    return 0o711 if reachable and shared() else 0o700


def make_folder(path: Path, directory: Path) -> Path:
    """``path`` made (or kept) with the mode ``folder_mode`` gives it."""
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, folder_mode(path, directory))
    return path


def make_private(directory: Path, shared_logs: set[str]) -> int:
    """Bring an existing queue folder to the modes above; the number of files and folders that let others in
    further than that.
    ``shared_logs``: the ids of jobs submitted with --share-logs. The daemon owns everything here but the logs
    and the spool's folders, which it chmods in place (their names are in folders only it may write, so they
    are what it made) and never descends into; symlinks are left alone (only the daemon could have made one)."""
    changed = 0
    for path, mode in _wanted_modes(directory, shared_logs):
        try:
            found = os.lstat(path)
        except FileNotFoundError:  # a running shim's temporary file, gone since the walk saw it
            continue
        if stat.S_ISLNK(found.st_mode) or stat.S_IMODE(found.st_mode) == mode:
            continue
        os.chmod(path, mode)
        changed += bool(stat.S_IMODE(found.st_mode) & ~mode)  # a mode that let others in: said
    return changed


def _wanted_modes(directory: Path, shared_logs: set[str]) -> Iterator[tuple[Path, int]]:
    yield directory, folder_mode(directory, directory)
    ours = os.geteuid()
    for root, folders, names in os.walk(directory):
        here = Path(root)
        for name in list(folders):
            path = here / name
            if _owner(path) != ours:  # a user's records: its mode only, not what the user put in it
                folders.remove(name)
                yield path, 0o700
            else:
                yield path, folder_mode(path, directory)
        for name in names:
            path = here / name
            if name == "output.log" and here.parent.name == "jobs":
                yield path, 0o644 if here.name in shared_logs else 0o600
            elif name != "queue.sock":  # made anew at each start, with its own mode
                yield path, 0o600


def _owner(path: Path) -> int | None:
    try:
        return os.lstat(path).st_uid
    except FileNotFoundError:
        return None


def free_bytes(directory: Path) -> int:
    found = os.statvfs(directory)
    return found.f_bavail * found.f_frsize


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the queue's disk (or the user's quota on it) is full: an OSError's ENOSPC or
    EDQUOT, or SQLite's SQLITE_FULL."""
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return files.disk_full(exc)
