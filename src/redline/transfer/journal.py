"""A download's state beside its destination, so a kill -9 or a dropped link resumes where it was.

``DEST.redline-part`` holds the bytes at their final offsets; ``DEST.redline-journal`` is JSON lines: a header
(the source, its size and validators, the chunk size) and then one line per finished chunk with its SHA-256.
A chunk is written to the part file as it arrives and recorded only once all of it is there, so a transfer cut
anywhere re-fetches at most the chunks that were in flight: one per connection. Lines are appended, never
rewritten: a line torn by a kill is ignored, and so is a chunk whose bytes no longer match its hash (the part
file's pages did not all reach the disk before a power cut).

When the transfer finishes, the part file is renamed over the destination (atomically, after fsync) and the
journal removed; until then the destination, if it existed, is untouched. Both files are opened inside the
destination's folder without following a symlink (``landing``), and an earlier run's are taken up only when
they are this user's regular files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from redline.transfer.landing import Landing
from redline.transfer.source import Remote, TransferError

VERSION = 1
PART = ".redline-part"
JOURNAL = ".redline-journal"
_READ_BYTES = 4 << 20


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + PART)


def journal_path(dest: Path) -> Path:
    return dest.with_name(dest.name + JOURNAL)


def landing(dest: Path) -> Landing:
    """``dest``'s folder, opened, with the names of its part file and journal."""
    return Landing(dest, dest.name + PART, dest.name + JOURNAL)


def chunks(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk; an empty file has none."""
    return [(start, min(size, start + chunk_bytes)) for start in range(0, size, chunk_bytes)]


def hash_range(fd: int, start: int, end: int) -> str:
    digest = hashlib.sha256()
    offset = start
    while offset < end:
        piece = os.pread(fd, min(_READ_BYTES, end - offset), offset)
        if not piece:
            break
        digest.update(piece)
        offset += len(piece)
    return digest.hexdigest()


@dataclass
class Journal:
    """The state of one destination. ``done`` maps chunk index to SHA-256 of the chunks verified on disk. Its
    files are opened inside the destination's folder (``landing``), never through a symlink."""

    landing: Landing
    remote: Remote
    chunk_bytes: int
    done: dict[int, str] = field(default_factory=dict)
    resumed: bool = False  # an earlier run's chunks were found and kept
    restarted_because: str | None = None  # why an earlier run's state was thrown away
    closed: bool = False  # the file failed: chunks still in flight record nothing
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, landing: Landing, remote: Remote, chunk_bytes: int) -> Journal:
        """Resume from an earlier run's state when it describes the same remote file, else start anew.
        The part file is sized to the remote file (sparse until written; empty while its size is unknown)."""
        journal = cls(landing, remote, chunk_bytes)
        header = {"version": VERSION, "source": remote.url, "chunk_bytes": chunk_bytes, **remote.validators()}
        earlier = journal._read_earlier() if remote.size is not None else None
        if earlier is not None:
            old_header, done = earlier
            # the chunk size is the earlier run's, whatever this run's link suggests: its chunks stay valid
            header["chunk_bytes"] = journal.chunk_bytes = int(old_header.get("chunk_bytes") or chunk_bytes)
            why = _why_differs(old_header, header)
            if why is None:
                journal.done = journal._verified(done)
                journal.resumed = bool(journal.done)
                header = old_header
                why = None if journal.done or done == {} else "its recorded blocks are not in the part file"
            journal.restarted_because = why
        if not journal.resumed:
            journal._start(header)
        return journal

    def _start(self, header: dict) -> None:
        """A new part file (sized, sparse) and a journal holding ``header``, each made afresh."""
        fd = self.landing.create(self.landing.part)
        try:
            os.ftruncate(fd, self.remote.size or 0)
        finally:
            os.close(fd)
        fd = self.landing.create(self.landing.journal)
        try:
            os.write(fd, (json.dumps(header) + "\n").encode())
        finally:
            os.close(fd)

    def _read_earlier(self) -> tuple[dict, dict[int, str]] | None:
        """An earlier run's header and recorded blocks, from a journal that is this user's regular file."""
        fd = self.landing.open_own(self.landing.journal, os.O_RDONLY)
        if fd is None:
            return None
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                lines = f.read().decode("utf-8", errors="replace").splitlines()
        finally:
            os.close(fd)
        records = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
        if not records or not isinstance(records[0], dict) or records[0].get("version") != VERSION:
            return None
        done = {int(r["chunk"]): str(r["sha256"]) for r in records[1:] if isinstance(r, dict) and "chunk" in r}
        return records[0], done

    def _verified(self, done: dict[int, str]) -> dict[int, str]:
        """The recorded chunks whose bytes in the part file (this user's, not a link) still hash to what was
        recorded."""
        size = self.remote.size
        if size is None:  # a file of unknown length is read whole each time: nothing of it is kept (open)
            return {}
        fd = self.landing.open_own(self.landing.part, os.O_RDONLY)
        if fd is None:
            return {}
        spans = chunks(size, self.chunk_bytes)
        try:
            if os.fstat(fd).st_size != size:
                return {}
            return {i: sha for i, sha in done.items() if 0 <= i < len(spans) and hash_range(fd, *spans[i]) == sha}
        finally:
            os.close(fd)

    def forget(self) -> None:
        """Start over: no block kept (a server without ranges cannot send the ones missing alone)."""
        self.done, self.resumed = {}, False
        self._start({"version": VERSION, "source": self.remote.url, "chunk_bytes": self.chunk_bytes,
                     **self.remote.validators()})  # fmt: skip

    def record(self, index: int, sha256: str) -> None:
        with self._lock:
            if self.closed:
                return
            self.done[index] = sha256
            # opened per record, not held: a fetch of 100,000 files must not hold a descriptor per file
            fd = self.landing.open_own(self.landing.journal, os.O_WRONLY | os.O_APPEND)
            if fd is None:
                raise TransferError(f"{journal_path(self.landing.dest)}: replaced by something else during the fetch")
            try:
                os.write(fd, (json.dumps({"chunk": index, "sha256": sha256}) + "\n").encode())
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            self.closed = True

    def discard(self) -> None:
        """Remove the part file and the journal (a finished or hopeless transfer)."""
        self.close()
        self.landing.remove(self.landing.part)
        self.landing.remove(self.landing.journal)


def _why_differs(old: dict, new: dict) -> str | None:
    """Why an earlier run's state is not of this remote file, or None when it is. The validators decide, not
    the URL: the same file from a mirror (same size, ETag, Last-Modified) resumes; with no validator at all,
    only the same URL does."""
    if old.get("version") != new.get("version"):
        return "its state was written by another version"
    for key in ("size", "etag", "last_modified"):
        if old.get(key) != new.get(key):
            return f"the remote file changed ({key} {old.get(key)} -> {new.get(key)})"
    if new.get("etag") is None and new.get("last_modified") is None and old.get("source") != new.get("source"):
        return "it came from another source, and nothing says it is the same file"
    return None
