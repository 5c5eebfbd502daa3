"""The download engine: many files and many chunks at once, each chunk retried alone, each file verified
and renamed into place when its last chunk lands.

One pool of worker threads (the streams) takes chunks in file order, so files finish in the order given
(what a loader reading shard after shard wants); a semaphore per endpoint keeps any one server under its
connection cap. A chunk that fails for a reason a retry may fix (a reset, a read timeout, a 503) is fetched
again from its start after a jittered, doubling pause ("full jitter": many streams cut by one outage do not
come back in step); one that cannot (404, denied, the file changed) fails its file, and the other files go on.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from redline.transfer import journal as journals
from redline.transfer.link import DEFAULT_PER_ENDPOINT, Link
from redline.transfer.source import Remote, Source, TransferError

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
STAT_AHEAD = 8  # files stat'ed at once ahead of the chunks


@dataclass
class Options:
    streams: int | None = None  # chunks in flight at once; None: what the link needs
    per_endpoint: int = DEFAULT_PER_ENDPOINT
    chunk_bytes: int | None = None  # None: max(8 MiB, 2 x BDP)
    retries: int = 10  # per chunk, for failures a retry may fix
    overwrite: bool = False  # replace a destination that exists and differs from the remote file


@dataclass
class Item:
    """One file to fetch: where from, where to, and its SHA-256 when the user knows it."""

    source: Source
    dest: Path
    sha256: str | None = None


@dataclass
class FileResult:
    url: str
    dest: str
    size: int | None = None
    status: str = "pending"  # fetched, present (already there, the same file), failed
    moved_bytes: int = 0  # bytes this run received for it, retried ones included
    resumed_bytes: int = 0  # bytes an earlier run had fetched and this one kept
    retries: int = 0
    sha256: str | None = None
    verified_against: str | None = None  # "the store's checksum", "--checksum"; None: no reference known
    note: str | None = None  # why an earlier run's state was dropped
    error: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Progress:
    """What the engine tells whoever draws progress; this base draws nothing."""

    def add_total(self, size: int) -> None: ...
    def advance(self, size: int) -> None: ...  # negative when a failed chunk's bytes are fetched again
    def active(self, streams: int) -> None: ...
    def finished(self, result: FileResult) -> None: ...


@dataclass
class Summary:
    files: list[FileResult]
    seconds: float
    streams: int
    chunk_bytes: int
    link: Link
    congestion: str | None

    @property
    def moved_bytes(self) -> int:
        return sum(f.moved_bytes for f in self.files)

    @property
    def bits_per_s(self) -> float:
        return self.moved_bytes * 8 / self.seconds if self.seconds > 0 else 0.0

    @property
    def failed(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "failed"]

    def to_dict(self) -> dict:
        return {
            "files": [f.to_dict() for f in self.files],
            "seconds": self.seconds,
            "moved_bytes": self.moved_bytes,
            "mbit_s": self.bits_per_s / 1e6,
            "streams": self.streams,
            "chunk_bytes": self.chunk_bytes,
            "link": self.link.__dict__ | {"described": self.link.describe()},
            "congestion_control": self.congestion,
        }


@dataclass
class _File:
    item: Item
    result: FileResult
    remote: Remote | None = None
    journal: journals.Journal | None = None
    left: int = 0
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def retryable_errors() -> tuple[type[BaseException], ...]:
    """What a retry may cure: the network's errors and those of the clients that speak over it."""
    errors: list[type[BaseException]] = [OSError, EOFError]
    import urllib3.exceptions

    errors.append(urllib3.exceptions.HTTPError)
    try:
        import paramiko

        errors.append(paramiko.SSHException)
    except ImportError:
        pass
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += [BotoCoreError, ClientError]
    except ImportError:
        pass
    return tuple(errors)


class Fetch:
    def __init__(
        self, items: list[Item], options: Options, link: Link, congestion: str | None, progress: Progress | None = None
    ) -> None:
        self.options, self.link, self.congestion = options, link, congestion
        self.progress = progress or Progress()
        self.files = [_File(item, FileResult(item.source.url, str(item.dest))) for item in items]
        endpoints = {item.source.endpoint for item in items}
        self.streams = options.streams or link.streams(options.per_endpoint * max(1, len(endpoints)))
        self.chunk_bytes = options.chunk_bytes or link.chunk_bytes()
        self._caps = {endpoint: threading.Semaphore(options.per_endpoint) for endpoint in endpoints}
        self._retryable = retryable_errors()
        self._active = 0
        self._active_lock = threading.Lock()
        self._stop = threading.Event()

    def run(self) -> Summary:
        start = time.perf_counter()
        # files are stat'ed a few at a time while the chunks of those ready already move: over a long link a
        # stat is a round trip, and thousands of them must not all come before the first byte
        with (
            ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="fetch") as pool,
            ThreadPoolExecutor(max_workers=min(self.streams, STAT_AHEAD), thread_name_prefix="stat") as stats,
        ):
            try:
                chunks = [
                    pool.submit(self._chunk, f, i)
                    for f in stats.map(self._prepared, self.files)
                    if not f.failed and f.journal is not None
                    for i in self._missing(f)
                ]
                for done in chunks:
                    done.result()
            except BaseException:  # Ctrl-C: stop the chunks in flight at their next piece; the journal keeps the rest
                self._stop.set()
                pool.shutdown(cancel_futures=True)
                stats.shutdown(cancel_futures=True)
                raise
        for f in self.files:
            if f.journal is not None and f.result.status == "pending" and f.left == 0 and not f.failed:
                self._finish(f)  # files with no chunk left to fetch (empty, or all kept from an earlier run)
        return Summary(
            [f.result for f in self.files],
            time.perf_counter() - start,
            self.streams,
            self.chunk_bytes,
            self.link,
            self.congestion,
        )

    # ------------------------------------------------------------------------------------------- per file

    def _prepared(self, f: _File) -> _File:
        self._prepare(f)
        return f

    def _prepare(self, f: _File) -> None:
        """Stat the remote file, skip it when the destination already is it, else open its journal."""
        try:
            f.remote = self._retry(f, f.item.source.stat)
            f.result.size = f.remote.size
            dest = f.item.dest
            if not journals.journal_path(dest).exists() and dest.exists():
                if _is_same(dest, f.remote):
                    f.result.status = "present"
                    self.progress.finished(f.result)
                    return
                if not self.options.overwrite:
                    raise TransferError(f"{dest}: exists and is not {f.remote.url} (--overwrite replaces it)")
            dest.parent.mkdir(parents=True, exist_ok=True)
            f.journal = journals.Journal.open(dest, f.remote, self.chunk_bytes)
        except TransferError as exc:
            self._fail(f, str(exc))
            return
        except OSError as exc:
            self._fail(f, f"{f.item.dest}: {exc.strerror or exc}")
            return
        f.result.note = f.journal.restarted_because and f"started anew: {f.journal.restarted_because}"
        spans = journals.chunks(f.remote.size, f.journal.chunk_bytes)
        f.result.resumed_bytes = sum(end - start for i, (start, end) in enumerate(spans) if i in f.journal.done)
        f.left = len(spans) - len(f.journal.done)
        self.progress.add_total(f.remote.size)
        self.progress.advance(f.result.resumed_bytes)

    def _missing(self, f: _File) -> list[int]:
        spans = journals.chunks(f.remote.size, f.journal.chunk_bytes)
        return [i for i in range(len(spans)) if i not in f.journal.done]

    def _chunk(self, f: _File, index: int) -> None:
        if f.failed:
            return
        start, end = journals.chunks(f.remote.size, f.journal.chunk_bytes)[index]
        with self._caps[f.item.source.endpoint], self._stream():
            try:
                sha = self._retry(f, lambda: self._read(f, start, end))
            except TransferError as exc:
                self._fail(f, str(exc))
                return
        f.journal.record(index, sha)
        with f.lock:
            f.left -= 1
            last = f.left == 0
        if last:
            self._finish(f)

    def _read(self, f: _File, start: int, end: int) -> str:
        """Fetch one chunk into the part file at its offset; its SHA-256. The part file is opened per chunk:
        a fetch of many files holds descriptors for the chunks in flight only."""
        digest = hashlib.sha256()
        offset = start
        fd = os.open(journals.part_path(f.item.dest), os.O_WRONLY)

        def sink(piece: bytes) -> None:
            nonlocal offset
            if self._stop.is_set():
                raise TransferError(f"{f.item.source.url}: stopped")
            view = memoryview(piece)
            while view:
                written = os.pwrite(fd, view, offset)
                view = view[written:]
                offset += written
            digest.update(piece)
            with f.lock:
                f.result.moved_bytes += len(piece)
            self.progress.advance(len(piece))

        try:
            f.item.source.read(f.remote, start, end, sink)
        except BaseException:
            self.progress.advance(-(offset - start))  # these bytes come again
            raise
        finally:
            os.close(fd)
        return digest.hexdigest()

    def _retry(self, f: _File, attempt: Callable):
        return retrying(attempt, self.options.retries, self._retryable, f.result, lambda: f.failed)

    def _finish(self, f: _File) -> None:
        """Verify the whole file, then put it in place: fsync, rename over the destination, fsync the folder."""
        dest, part = f.item.dest, journals.part_path(f.item.dest)
        try:
            with open(part, "rb") as data:
                os.fsync(data.fileno())
                f.result.sha256 = journals.hash_range(data.fileno(), 0, f.remote.size)
            expected, against = _reference(f)
            if expected is not None:
                f.result.verified_against = against
                if expected.lower() != f.result.sha256:
                    f.journal.discard()
                    raise TransferError(
                        f"{f.remote.url}: SHA-256 {f.result.sha256} is not {expected.lower()} ({against}): the data "
                        "is corrupt at the source or was corrupted on the way; nothing was written to the destination"
                    )
            if f.remote.last_modified is not None:
                os.utime(part, (f.remote.last_modified, f.remote.last_modified))
            os.replace(part, dest)
            _fsync_dir(dest.parent)
            f.journal.discard()
        except TransferError as exc:
            self._fail(f, str(exc))
            return
        except OSError as exc:
            self._fail(f, f"{dest}: {exc.strerror or exc}")
            return
        f.result.status = "fetched"
        self.progress.finished(f.result)

    def _fail(self, f: _File, message: str) -> None:
        with f.lock:
            if f.failed:
                return
            f.failed = True
        f.result.status, f.result.error = "failed", message
        if f.journal is not None:
            f.journal.close()  # the part file and journal stay: a later run resumes from them
        self.progress.finished(f.result)

    def _stream(self):
        engine = self

        class _Active:
            def __enter__(self) -> None:
                with engine._active_lock:
                    engine._active += 1
                    engine.progress.active(engine._active)

            def __exit__(self, *exc) -> None:
                with engine._active_lock:
                    engine._active -= 1
                    engine.progress.active(engine._active)

        return _Active()


def retrying(attempt: Callable, retries: int, retryable: tuple, result: FileResult, abandoned: Callable[[], bool]):
    """``attempt()``, tried again after failures a retry may cure, at most ``retries`` times, after a pause drawn
    at random up to a doubling ceiling; TransferError, naming the last failure, when the tries run out."""
    for tries in range(retries + 1):
        try:
            return attempt()
        except TransferError:
            raise
        except retryable as exc:
            if tries == retries or abandoned():
                raise TransferError(f"{result.url}: gave up after {tries + 1} tries: {_one_line(exc)}") from None
            result.retries += 1
            time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**tries)))
    raise AssertionError("unreachable")


def _reference(f: _File) -> tuple[str | None, str | None]:
    if f.item.sha256:
        return f.item.sha256, "--checksum"
    if f.remote.checksum and f.remote.checksum[0] == "sha256":
        return f.remote.checksum[1], "the store's checksum"
    return None, None


def _is_same(dest: Path, remote: Remote) -> bool:
    """A destination already holding the remote file, as a fetch leaves it: its size, and its mtime set to
    the remote's Last-Modified (rclone and wget -N judge by the same two)."""
    info = dest.stat()
    if info.st_size != remote.size:
        return False
    return remote.last_modified is None or abs(info.st_mtime - remote.last_modified) < 1.0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 300 else text[:297] + "..."
