"""The download engine: streams that each read a long range of a file, and take over half of another's when
they run out, as aria2 splits segments; files verified and renamed into place when their last block lands.

A file is cut into blocks (256 KiB, or the chunk size when smaller): the journal's unit, each recorded with
its SHA-256 as soon as it is on disk, and the smallest piece of work one stream hands another. Small, because
at the end of a transfer over a lossy long link one stream whose window a loss just halved reads at 2-3 Mbit/s:
a 1 MiB block it holds would keep the whole fetch waiting some 3 s, a 256 KiB one under 1 s.

A stream takes a segment: a run of blocks as long as the file's remaining work shared over the streams, read in
requests of a chunk (max(8 MiB, 2 x BDP)) each, so a request keeps its stream busy for many round trips.
Segments go out in file order, so files finish in the order given (what a loader reading shard after shard
wants), at most ``per_endpoint`` at once to any one server. When no block is left to hand out, an idle stream
takes the second half of the longest segment still being read: the tail of a transfer is then read by every
stream, not by the unluckiest one alone. The stream that gave it up stops within a few packets of the new
segment's start (bytes are taken as they arrive, not a block at a time).

A failure a retry may cure is retried from the first block not yet on disk; a kill, a dropped link, or Ctrl-C
loses at most the block each stream was reading.

One process writes a destination at a time: a file's journal is locked (``redline.lockfile``, released by the
kernel if its holder dies) from before its destination is looked at until it lands or fails. A second fetch of
the same destination waits for the first, then finds the file there (as huggingface_hub's downloads wait on
each other's locks) instead of writing the same part file under it. Each locked file holds a descriptor, so
files are admitted a bounded number ahead of the streams.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from redline.errors import BadInput
from redline.files import disk_full
from redline.lockfile import HeldElsewhere, WriterLock
from redline.transfer import journal as journals
from redline.transfer.engine import FileResult, Item, Options, Progress, Summary, retrying
from redline.transfer.landing import Landing, NoSpace
from redline.transfer.limits import host_streams
from redline.transfer.link import MIN_CHUNK_BYTES, Link, to_endpoint
from redline.transfer.source import Remote, TransferError
from redline.units import KiB, fmt_bytes

BLOCK_BYTES = 256 * KiB
STAT_AHEAD = 8  # files stat'ed at once, ahead of the streams
SPLIT_POLL_S = 0.25  # how often an idle stream looks again for a segment to share
SPLIT_AFTER_S = 1.0  # a stream this far from the end of its segment gives half of what waits to an idle one
LOCK_POLL_S = 0.2  # how often a file another process is fetching is looked at again
MAX_FILES_AHEAD = 256  # files admitted (locked, their journal open) and not yet landed or failed, at most
JOURNAL_LINE_BYTES = 100  # a block's line in the journal: {"chunk": N, "sha256": 64 hex digits}, with room


@dataclass
class _File:
    index: int
    item: Item
    result: FileResult
    remote: Remote | None = None
    journal: journals.Journal | None = None
    landing: Landing | None = None  # the destination's folder, open while the file is admitted
    admitted: bool = False  # counts among the files admitted ahead of the streams
    writer: WriterLock | None = None  # held from before the destination is looked at until it lands or fails
    holes: list[list[int]] = field(default_factory=list)  # [first, end) block runs neither done nor handed out
    left: int = 0  # blocks not yet on disk
    failed: bool = False
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stated(self) -> Remote:
        """The remote file as stat'ed: ``Fetch._prepare`` sets it before any other step reads it."""
        if self.remote is None:
            raise RuntimeError(f"{self.item.source.url}: used before it was stat'ed")
        return self.remote

    def opened(self) -> journals.Journal:
        """Its journal: ``Fetch._prepare`` opens it before a block of the file is handed out or it is finished."""
        if self.journal is None:
            raise RuntimeError(f"{self.item.source.url}: its blocks were used before its journal was opened")
        return self.journal

    def size_bytes(self) -> int:
        """The remote file's length: known before a block is handed out or the file is finished (one of unknown
        length is read whole by ``Fetch._whole``, which sets the size that came)."""
        size = self.stated().size
        if size is None:
            raise RuntimeError(f"{self.item.source.url}: its blocks were used before its length was known")
        return size

    def block_span(self, block: int) -> tuple[int, int]:
        size = self.opened().chunk_bytes
        return block * size, min(self.size_bytes(), (block + 1) * size)


@dataclass
class _Segment:
    file: _File
    start: int  # the block being read; advances as blocks land
    end: int  # past the last block; lowered when another stream takes the tail
    requested: int = 0  # past the last block the request in flight asked for
    began_s: float = field(default_factory=time.monotonic)
    received_bytes: int = 0

    def seconds_left(self, block_bytes: int) -> float:
        """How long its stream will take for the blocks after the one it reads, at the rate it has had."""
        elapsed = time.monotonic() - self.began_s
        if self.received_bytes == 0 or elapsed <= 0:
            return 0.0  # nothing to judge by yet
        return (self.end - self.start - 1) * block_bytes / (self.received_bytes / elapsed)


class _Enough(Exception):
    """The rest of this segment went to another stream."""


class Fetch:
    """One fetch of ``items``. ``link`` None: the path to the first file's endpoint is measured while the first
    files are stat'ed (``to_endpoint``), so the probe's round trip costs no time of its own."""

    def __init__(
        self,
        items: list[Item],
        options: Options,
        link: Link | None,
        congestion: str | None,
        progress: Progress | None = None,
    ) -> None:
        self.options, self.link, self.congestion = options, link, congestion
        self.progress = progress or Progress()
        self.files = [_File(i, item, FileResult(item.source.url, str(item.dest))) for i, item in enumerate(items)]
        self.endpoints = {item.source.endpoint for item in items}
        # the journal's block: known before the link is (a chunk is never under MIN_CHUNK_BYTES unless set)
        self.block_bytes = min(BLOCK_BYTES, options.chunk_bytes or MIN_CHUNK_BYTES)
        self.streams = self.chunk_bytes = 0  # from the link, once known (run)
        self._cond = threading.Condition()
        self._ready: list[_File] = []  # stat'ed files with blocks to hand out, in the order given
        self._active: list[_Segment] = []
        self._per_endpoint: dict[str, int] = dict.fromkeys(self.endpoints, 0)
        self._all_admitted = False
        self._stop = threading.Event()
        self._files_ahead = _files_ahead()
        self._open_files = 0  # admitted, not yet landed or failed

    def run(self) -> Summary:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=STAT_AHEAD, thread_name_prefix="stat") as stats:
            admitted = [stats.submit(self._admit, f) for f in self.files]
            try:
                link = self._size_to_link()
                with ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="fetch") as pool:
                    streams = [pool.submit(self._stream) for _ in range(self.streams)]
                    try:
                        for future in admitted:
                            future.result()
                        with self._cond:
                            self._all_admitted = True
                            self._cond.notify_all()
                        for future in streams:
                            future.result()
                    except BaseException:  # Ctrl-C: each stream stops at its next piece; the journal keeps the rest
                        self._halt()
                        raise
            except BaseException:
                self._halt()
                stats.shutdown(cancel_futures=True)
                raise
            finally:
                for f in self.files:  # a stopped run's files: their part file and journal stay for the next run
                    self._unlock(f)
        return Summary(
            [f.result for f in self.files],
            time.perf_counter() - start,
            self.streams,
            self.chunk_bytes,
            link,
            self.congestion,
        )

    def _halt(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _size_to_link(self) -> Link:
        """Streams and chunk size from the link, measured now (while the first files are stat'ed) when not given;
        the link."""
        if self.link is None:
            self.link = to_endpoint(self.files[0].item.source.endpoint, "down")
        cap = min(self.options.per_endpoint * max(1, len(self.endpoints)), host_streams())
        self.streams = self.options.streams or self.link.streams(cap)
        self.chunk_bytes = self.options.chunk_bytes or self.link.chunk_bytes()
        return self.link

    # ------------------------------------------------------------------------------------- handing out work

    def _admit(self, f: _File) -> None:
        with self._cond:
            while self._open_files >= self._files_ahead and not self._stop.is_set():
                self._cond.wait()
            if self._stop.is_set():
                return
            self._open_files += 1
            f.admitted = True
        self._prepare(f)
        if f.failed or f.journal is None:
            return
        size = f.stated().size
        if size is None:  # no length given: read to its end here, in one piece
            self._whole(f)
            return
        if f.left == 0:  # empty, or every block kept from an earlier run
            self._finish(f)
            return
        missing = [i for i in range(len(journals.chunks(size, f.journal.chunk_bytes))) if i not in f.journal.done]
        for block in missing:  # runs of consecutive missing blocks
            if f.holes and f.holes[-1][1] == block:
                f.holes[-1][1] += 1
            else:
                f.holes.append([block, block + 1])
        with self._cond:
            self._ready.append(f)
            self._ready.sort(key=lambda ready: ready.index)
            self._cond.notify_all()

    def _next_segment(self) -> _Segment | None:
        """A segment for an idle stream: fresh blocks first, else half of another stream's (``_split``); None
        once every file has been stat'ed and no segment is left being read."""
        with self._cond:
            while not self._stop.is_set():
                segment = self._fresh() or self._split()
                if segment is not None:
                    self._active.append(segment)
                    self._per_endpoint[segment.file.item.source.endpoint] += 1
                    self.progress.active(len(self._active))
                    return segment
                if self._all_admitted and not self._active:
                    return None
                # an idle stream stays while others read: one of them may slow down enough to share its tail
                self._cond.wait(timeout=SPLIT_POLL_S if self._active else None)
            return None

    def _room(self, f: _File) -> bool:
        return self._per_endpoint[f.item.source.endpoint] < self.options.per_endpoint

    def _fresh(self) -> _Segment | None:
        for f in self._ready:
            if f.failed or not f.holes or not self._room(f):
                continue
            first, end = f.holes[0]
            share = -(-sum(b - a for a, b in f.holes) // self.streams)
            take = min(end - first, max(share, self.chunk_bytes // f.opened().chunk_bytes, 1))
            if not f.stated().ranged:  # each request brings the whole file: one stream reads all of it
                take = end - first
            if take == end - first:
                f.holes.pop(0)
            else:
                f.holes[0][0] = first + take
            return _Segment(f, first, first + take)
        return None

    def _split(self) -> _Segment | None:
        """Work for an idle stream when no block is left to hand out: half of the blocks another stream has
        not asked for yet (nothing on the way is lost), else half of what waits in the request of the stream
        that, at the rate it has had, will finish last, when that is over SPLIT_AFTER_S away (on a lossy link
        one stream whose window a loss just halved crawls while the others are done; it stops where the new
        segment begins and drops its connection, with what was on the way)."""
        victims = [s for s in self._active if not s.file.failed and s.file.stated().ranged and self._room(s.file)]
        if not victims:
            return None
        roomiest = max(victims, key=lambda s: s.end - max(s.requested, s.start + 1))
        if roomiest.end - max(roomiest.requested, roomiest.start + 1) >= 1:
            victim = roomiest
            middle = max(victim.requested, victim.start + 1, victim.end - max(1, (victim.end - victim.start - 1) // 2))
        else:
            victim = max(victims, key=lambda s: s.seconds_left(s.file.opened().chunk_bytes))
            waiting = victim.end - victim.start - 1  # the block being read stays with its stream
            if waiting < 1 or victim.seconds_left(victim.file.opened().chunk_bytes) < SPLIT_AFTER_S:
                return None
            middle = victim.end - max(1, waiting // 2)
        if middle >= victim.end:
            return None
        tail = _Segment(victim.file, middle, victim.end, requested=middle)
        victim.end = middle
        return tail

    def _release(self, segment: _Segment) -> None:
        with self._cond:
            self._active.remove(segment)
            self._per_endpoint[segment.file.item.source.endpoint] -= 1
            self.progress.active(len(self._active))
            self._cond.notify_all()

    # -------------------------------------------------------------------------------------------- streams

    def _stream(self) -> None:
        self.files[0].item.source.connect()  # while the first files are stat'ed
        while (segment := self._next_segment()) is not None:
            try:
                self._serve(segment)
            finally:
                self._release(segment)

    def _serve(self, segment: _Segment) -> None:
        """Read one segment, with retries; finish its file when that was the file's last block."""
        f = segment.file
        try:
            retrying(lambda: self._read(segment), self.options.retries, f.result, lambda: f.failed)
        except TransferError as exc:
            self._fail(f, str(exc))
            return
        with f.lock:
            last = f.left == 0 and not f.failed and not f.done
            f.done = f.done or last
        if last:
            self._finish(f)

    def _read(self, segment: _Segment) -> None:
        """Read the segment's blocks from the first not yet on disk to its end (which may move closer while
        it is read), in requests of a chunk each."""
        per_request = max(1, self.chunk_bytes // segment.file.opened().chunk_bytes)
        if not segment.file.stated().ranged:
            per_request = segment.end  # one request for all of it, however long
        while True:
            with self._cond:
                first, end = segment.start, min(segment.end, segment.start + per_request)
                segment.requested = end
            if first >= end:
                return
            self._request(segment, first, end)

    def _request(self, segment: _Segment, first: int, end: int) -> None:
        """One range request: each block written at its offset as it arrives and recorded once whole. The
        part file is opened per request: a fetch of many files holds descriptors for the requests in flight."""
        f = segment.file
        blocks = len(journals.chunks(f.size_bytes(), f.opened().chunk_bytes))
        block = first
        block_start, block_end = f.block_span(block)
        position, digest = block_start, hashlib.sha256()
        fd = self._open_part(f)

        def sink(piece: bytes) -> None:
            nonlocal block, block_start, block_end, position, digest
            if self._stop.is_set() or f.failed:
                raise TransferError(f"{f.item.source.url}: stopped")
            view = memoryview(piece)
            while view:
                if block >= segment.end:
                    raise _Enough
                take = min(len(view), block_end - position)
                os.pwrite(fd, view[:take], position)  # a regular file takes a pwrite whole
                digest.update(view[:take])
                position += take
                view = view[take:]
                with f.lock:
                    f.result.moved_bytes += take
                segment.received_bytes += take
                self.progress.advance(take)
                if position == block_end:
                    self._landed(segment, block, digest.hexdigest())
                    block += 1
                    if block < blocks:
                        block_start, block_end = f.block_span(block)
                    digest = hashlib.sha256()

        try:
            f.item.source.read(f.stated(), f.block_span(first)[0], f.block_span(end - 1)[1], sink)
        except _Enough:
            pass
        except BaseException as exc:
            self.progress.advance(-(position - block_start))  # the block in flight comes again
            if isinstance(exc, OSError) and disk_full(exc):
                raise self._full(f, exc) from None
            raise
        finally:
            os.close(fd)

    def _open_part(self, f: _File) -> int:
        with f.lock:
            if f.failed or f.landing is None:
                raise TransferError(f"{f.item.source.url}: stopped")
            return f.landing.open_part()

    def _landed(self, segment: _Segment, block: int, sha256: str) -> None:
        f = segment.file
        f.opened().record(block, sha256)
        with self._cond:
            segment.start = block + 1
        with f.lock:
            f.left -= 1

    # ------------------------------------------------------------------------------------------- per file

    def _prepare(self, f: _File) -> None:
        """Stat the remote file (unless the caller just did), skip it when the destination already is it, else
        open its journal, once its disk has room for it."""
        try:
            remote = f.item.remote or retrying(f.item.source.stat, self.options.retries, f.result, lambda: False)
            f.remote, f.result.size = remote, remote.size
            f.landing = landing = journals.landing(f.item.dest)
            landing.destination()  # a symlink, a device, a FIFO: refused before a lock is made beside it
            self._lock(f)
            if self._present(f, landing, remote):
                return
            f.journal = journal = journals.Journal.open(landing, remote, self.block_bytes)
            self._from_scratch_without_ranges(f)
            self._check_room(f, landing)
        except TransferError as exc:
            self._fail(f, str(exc))
            return
        except OSError as exc:
            self._fail(f, f"{f.item.dest}: {exc.strerror or exc}")
            return
        f.result.note = f.result.note or (journal.restarted_because and f"started anew: {journal.restarted_because}")
        f.result.resumed_bytes = self._kept_bytes(f)
        f.left = len(journals.chunks(remote.size or 0, journal.chunk_bytes)) - len(journal.done)
        self.progress.add_total(remote.size or 0)
        self.progress.advance(f.result.resumed_bytes)

    def _present(self, f: _File, landing: Landing, remote: Remote) -> bool:
        """Whether the destination already is the remote file (then it is done); TransferError when it is
        another file and --overwrite was not given."""
        found = landing.destination()
        if found is None or landing.lstat(landing.journal) is not None:
            return False
        if _is_same(found, remote):
            f.result.status = "present"
            self._unlock(f)
            self.progress.finished(f.result)
            return True
        if not self.options.overwrite:
            raise TransferError(f"{f.item.dest}: exists and is not {remote.url} (--overwrite replaces it)")
        return False

    def _from_scratch_without_ranges(self, f: _File) -> None:
        """A server without byte ranges cannot send the blocks an earlier run lacked alone: it starts over."""
        journal = f.opened()
        if f.stated().ranged or not journal.done:
            return
        kept = self._kept_bytes(f)
        journal.forget()
        f.result.note = f"the server serves no byte ranges: the {fmt_bytes(kept)} an earlier run kept come again"

    def _kept_bytes(self, f: _File) -> int:
        journal = f.opened()
        spans = journals.chunks(f.stated().size or 0, journal.chunk_bytes)
        return sum(end - start for i, (start, end) in enumerate(spans) if i in journal.done)

    def _check_room(self, f: _File, landing: Landing) -> None:
        """NoSpace when the destination's disk cannot hold what is left of the file and its journal (the
        part file is sparse: blocks already there take no more); then nothing is left behind but what an
        earlier run verified."""
        size, journal = f.stated().size, f.opened()
        if size is None:
            return  # not known until it is read: a full disk fails it then, at once
        blocks = len(journals.chunks(size, journal.chunk_bytes))
        need = size - self._kept_bytes(f) + (blocks - len(journal.done)) * JOURNAL_LINE_BYTES
        free = landing.free_bytes()
        if need > free:
            if not journal.done:
                journal.discard()
            raise NoSpace(
                f"{f.item.dest}: needs {fmt_bytes(need)} free (the file and its journal) and its disk has "
                f"{fmt_bytes(free)}; nothing was fetched"
            )

    def _full(self, f: _File, exc: OSError) -> NoSpace:
        """The failure of a file whose disk filled up mid-fetch: at once, no retry; its verified blocks stay."""
        kept = fmt_bytes(self._kept_bytes(f)) if f.journal else "nothing"
        return NoSpace(
            f"{f.item.dest}: its disk is full ({exc.strerror}); {kept} verified is kept: free some space and "
            "run again to resume"
        )

    def _lock(self, f: _File) -> None:
        """Hold ``f``'s journal lock, waiting (told once) while another process fetches the same destination."""
        writer = WriterLock(journals.journal_path(f.item.dest), "download")
        told = False
        while True:
            try:
                f.writer = writer.acquire()
                return
            except HeldElsewhere as held:
                if not told:
                    who = f"pid {held.holder}" if held.holder else "another process"
                    self.progress.note(f"{f.item.dest}: {who} is fetching it; waiting for it to finish")
                    told = True
            except BadInput as exc:  # the lock cannot be made there (a name too long, a read-only folder)
                raise TransferError(str(exc)) from None
            if self._stop.wait(LOCK_POLL_S):
                raise TransferError(f"{f.item.source.url}: stopped")

    def _unlock(self, f: _File) -> None:
        """Let go of ``f``'s lock and its place among the files admitted, once: it landed, failed, or the run
        stopped."""
        with f.lock:  # a stream opens the part file under it (_open_part): none can use the folder once closed
            writer, admitted, landing = f.writer, f.admitted, f.landing
            f.writer, f.admitted, f.landing = None, False, None
        if writer is not None:
            writer.release()
        if landing is not None:
            landing.close()
        if admitted:
            with self._cond:
                self._open_files -= 1
                self._cond.notify_all()

    def _finish(self, f: _File) -> None:
        """Verify the whole file, then put it in place: fsync, rename over the destination, fsync the folder."""
        try:
            landing = f.landing
            if landing is None:  # unlocked: the file failed or the run stopped, as _open_part would say
                raise TransferError(f"{f.item.source.url}: stopped")
            fd = self._open_part(f)
            try:
                f.result.sha256 = journals.hash_range(fd, 0, f.size_bytes())
                self._verify(f)
                landing.land(fd, f.stated().last_modified)
            finally:
                os.close(fd)
            f.opened().discard()
            self._unlock(f)
        except TransferError as exc:
            self._fail(f, str(exc))
            return
        except OSError as exc:
            self._fail(f, f"{f.item.dest}: {exc.strerror or exc}")
            return
        f.result.status = "fetched"
        self.progress.finished(f.result)

    def _verify(self, f: _File) -> None:
        expected, against = _reference(f)
        if expected is None:
            return
        f.result.verified_against = against
        if expected.lower() != f.result.sha256:
            f.opened().discard()
            raise TransferError(
                f"{f.stated().url}: SHA-256 {f.result.sha256} is not {expected.lower()} ({against}): the data "
                "is corrupt at the source or was corrupted on the way; nothing was written to the destination"
            )

    def _whole(self, f: _File) -> None:
        """A file of unknown length (a chunked answer, no Content-Length): read to its end in one request,
        each retry from the start again, then its size is what came; no block is recorded (nothing to resume
        from, as a server without a length has no ranges either)."""
        remote = f.stated()
        written = 0

        def attempt() -> None:
            nonlocal written
            fd = self._open_part(f)
            self.progress.advance(-written)
            written = 0
            os.ftruncate(fd, 0)

            def sink(piece: bytes) -> None:
                nonlocal written
                if self._stop.is_set() or f.failed:
                    raise TransferError(f"{f.item.source.url}: stopped")
                os.pwrite(fd, piece, written)
                written += len(piece)
                f.result.moved_bytes += len(piece)
                self.progress.advance(len(piece))

            try:
                f.item.source.read(remote, 0, None, sink)
            except OSError as exc:
                if disk_full(exc):
                    raise self._full(f, exc) from None
                raise
            finally:
                os.close(fd)

        try:
            retrying(attempt, self.options.retries, f.result, lambda: f.failed or self._stop.is_set())
        except TransferError as exc:
            self._fail(f, str(exc))
            return
        f.remote = dataclasses.replace(remote, size=written)
        f.result.size = written
        self.progress.add_total(written)
        self._finish(f)

    def _fail(self, f: _File, message: str) -> None:
        with f.lock:
            if f.failed:
                return
            f.failed = True
        f.result.status, f.result.error = "failed", message
        if f.journal is not None:
            f.journal.close()  # the part file and journal stay: a later run resumes from them
        self._unlock(f)
        self.progress.finished(f.result)


def _files_ahead() -> int:
    """Files admitted at once: each holds two descriptors (its lock, its folder), so an eighth of those this
    process may open (a quarter for the files; the streams' sockets and part files need half, ``host_streams``),
    at least as many as are stat'ed at once."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_FILES_AHEAD
    return max(STAT_AHEAD, min(MAX_FILES_AHEAD, soft // 8))


def _reference(f: _File) -> tuple[str | None, str | None]:
    if f.item.sha256:
        return f.item.sha256, "--checksum"
    checksum = f.stated().checksum
    if checksum and checksum[0] == "sha256":
        return checksum[1], "the store's checksum"
    return None, None


def _is_same(found: os.stat_result, remote: Remote) -> bool:
    """A destination already holding the remote file, as a fetch leaves it: its size, and its mtime set to
    the remote's Last-Modified (rclone and wget -N judge by the same two)."""
    if found.st_size != remote.size:
        return False
    return remote.last_modified is None or abs(found.st_mtime - remote.last_modified) < 1.0
