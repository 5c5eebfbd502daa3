"""Storage: how fast the filesystem holding ``--path`` reads, the way a training job reads it.

Four figures, each the median of repeated passes (MB = 10^6 bytes, as fio's "MB/s"; 1 MiB = 2^20):

- ``seq_read``: MB/s, 1 MiB reads straight through the file (large shards, tar/webdataset streams);
- ``rand_read_4k``: IOPS, 4 KiB reads at random block offsets (small records, index lookups);
- ``rand_read_128k``: MB/s, 128 KiB reads at random offsets (a shuffled DataLoader reading shards);
- ``small_files``: files/s, whole 100 KiB files opened, read and closed (an ImageFolder-style Dataset).

The three file patterns are fio's ``--rw=read|randread --bs=... --numjobs=N --ioengine=psync``: N reader
threads, each with exactly one read in flight (a blocking ``preadv``, which releases the GIL), each over
its own 1/N slice of one test file (fio's ``--size=slice --offset_increment=slice``); random passes visit
every block of the slice at most once in shuffled order (fio's default random map, so no block is read
twice from cache). A pass stops when its slices are done or after the pass time limit (fio's
``--runtime`` without ``--time_based``). Throughput is total bytes over the span from the first reader's
start to the last one's end, as fio's group report divides total bytes by the longest job's runtime.

The page cache must not answer the reads: the file is read with O_DIRECT (aligned, mmap-allocated
buffers) where the filesystem accepts it; where it does not (some FUSE and network filesystems), it is
read through the cache after ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops the file's pages before each
pass (what fio's default ``--invalidate=1`` does). Writing /proc/sys/vm/drop_caches would need root and
empty every other tenant's cache, so it is never done. A file larger than RAM would also defeat the
cache, but at tens of GB it costs minutes to write; the method string says which way was used.

Each read costs Python a few microseconds besides the system call, so the threads top out near 200k
4 KiB reads/s on a 2-core VM (fio's C loop does ~1.4M from tmpfs). Disks are far below that at one read
in flight per reader (4 readers / ~80 us NVMe latency = ~50k IOPS), so there the figure is the disk's;
on a RAM-backed filesystem (tmpfs, flagged in ``extra["note"]``) the 4 KiB figure is Python's.

Everything the bench writes lives under a unique hidden name in the directory and is removed on the
way out, on errors and Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import random
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from redline.bench.context import BenchContext
from redline.bench.model import Measurement, Spread
from redline.errors import BadInput, RedlineError
from redline.hw.snapshot import Snapshot
from redline.hw.sysfs import SysFs
from redline.units import GiB, KiB, MiB

MB = 1e6  # throughput unit: MB/s means 10^6 bytes per second, as fio's "(MB/s)" and disk datasheets
ALIGN_BYTES = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the logical block; 4 KiB covers all
FILL_CHUNK_BYTES = 4 * MiB
TEMP_PREFIX = ".redline-bench-"
STOP_GRACE_S = 10.0  # after an error or Ctrl-C, how long to wait for reader threads to finish their read
MEMORY_FSTYPES = frozenset({"tmpfs", "ramfs"})
SMALL_FILES_PER_STEP = 100  # files written between two progress steps


@dataclass(frozen=True)
class Pattern:
    """One access pattern on the test file: block size, and sequential or random block order."""

    name: str
    block_bytes: int
    random: bool

    @property
    def fio_rw(self) -> str:
        return "randread" if self.random else "read"


SEQ_READ = Pattern("seq_read", MiB, random=False)
RAND_READ_4K = Pattern("rand_read_4k", 4 * KiB, random=True)
RAND_READ_128K = Pattern("rand_read_128k", 128 * KiB, random=True)
PATTERNS = (SEQ_READ, RAND_READ_4K, RAND_READ_128K)


@dataclass(frozen=True)
class Plan:
    """How much to do: test file size, small-file set, reader threads, repeats, per-pass time limit."""

    file_bytes: int
    small_files: int
    small_file_bytes: int
    jobs: int
    repeats: int
    pass_limit_s: float

    def __post_init__(self) -> None:
        if self.jobs < 1 or self.repeats < 1 or self.small_files < self.jobs:
            raise ValueError(f"bad storage plan {self}")
        if self.file_bytes < self.jobs * SEQ_READ.block_bytes or self.small_file_bytes % ALIGN_BYTES:
            raise ValueError(f"bad storage plan {self}")

    @property
    def needed_bytes(self) -> int:
        """Space the bench writes, plus a margin so it never fills the filesystem to the last block."""
        written = self.file_bytes + self.small_files * self.small_file_bytes
        return written + max(64 * MiB, written // 20)


# 4 readers, as the fio examples in most storage guides (--numjobs=4); each pass at most a few seconds
QUICK = Plan(file_bytes=256 * MiB, small_files=1000, small_file_bytes=100 * KiB, jobs=4, repeats=3, pass_limit_s=1.0)
FULL = Plan(file_bytes=2 * GiB, small_files=2000, small_file_bytes=100 * KiB, jobs=4, repeats=5, pass_limit_s=3.0)


@dataclass(frozen=True)
class Rate:
    """What one pass delivered: bytes and operations (reads, or files) per second."""

    bytes_per_s: float
    ops_per_s: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_per_s / MB


# ------------------------------------------------------------------------------------ the run


def run(ctx: BenchContext) -> list[Measurement]:
    return measure(ctx.path or ".", QUICK if ctx.quick else FULL, ctx)


def measure(path: str, plan: Plan, ctx: BenchContext | None = None) -> list[Measurement]:
    """Every storage figure for the filesystem holding ``path``; nothing is left in it afterwards."""
    ctx = ctx or BenchContext()
    directory = check_directory(path)
    where = filesystem_of(directory, ctx.snapshot)
    check_free_space(directory, plan)
    common = {"path": directory, **where}
    if where.get("fstype") in MEMORY_FSTYPES:
        common["note"] = f"{where['fstype']} keeps files in RAM: these are memory speeds, not a disk's"
    measurements = []
    with test_file(directory, plan.file_bytes, ctx) as tf:
        for pattern in PATTERNS:
            rates = []
            with ctx.task(f"storage {pattern.name}", plan.repeats) as step:
                for _ in range(plan.repeats):
                    rates.append(read_pass(tf, pattern, plan.jobs, plan.pass_limit_s))
                    step()
            measurements.append(_file_measurement(pattern, rates, tf, plan, common))
    with small_files(directory, plan.small_files, plan.small_file_bytes, plan.jobs, ctx) as files:
        rates = []
        with ctx.task("storage small_files", plan.repeats) as step:
            for _ in range(plan.repeats):
                rates.append(small_files_pass(files, plan.pass_limit_s))
                step()
        measurements.append(_small_files_measurement(rates, files, plan, common))
    return measurements


def _file_measurement(pattern: Pattern, rates: list[Rate], tf: TestFile, plan: Plan, common: dict) -> Measurement:
    by_iops = pattern is RAND_READ_4K  # small random reads are counted in operations, as fio and drive specs do
    samples = [r.ops_per_s if by_iops else r.mb_per_s for r in rates]
    order = "random block offsets, each block at most once" if pattern.random else "in order"
    cache = (
        "O_DIRECT (page cache bypassed)"
        if tf.direct
        else f"buffered, page cache dropped with posix_fadvise(DONTNEED) before each pass (O_DIRECT: {tf.no_direct})"
        + ("" if tf.cache_dropped else "; the drop could NOT be confirmed: figures may include cached reads")
    )
    return Measurement(
        suite="storage",
        name=pattern.name,
        value=Spread.of(samples).median,
        unit="IOPS" if by_iops else "MB/s",
        method=f"{plan.jobs} threads x 1 blocking preadv of {_size(pattern.block_bytes)}, {order}, each over its "
        f"own 1/{plan.jobs} of a {_size(tf.size_bytes)} file of random bytes; {cache}; MB = 10^6 bytes",
        device=common.get("source") or "",
        size={"file_bytes": tf.size_bytes, "block_bytes": pattern.block_bytes, "jobs": plan.jobs},
        repeats=len(rates),
        spread=Spread.of(samples),
        extra={
            **common,
            "direct_io": tf.direct,
            "page_cache_dropped": tf.cache_dropped,
            "pass_limit_s": plan.pass_limit_s,
            "mb_per_s": Spread.of([r.mb_per_s for r in rates]).median,
            "iops": Spread.of([r.ops_per_s for r in rates]).median,
            "fio_equivalent": shlex.join(fio_args(tf, pattern, plan.jobs, plan.pass_limit_s)),
        },
    )


def _small_files_measurement(rates: list[Rate], files: SmallFiles, plan: Plan, common: dict) -> Measurement:
    samples = [r.ops_per_s for r in rates]
    return Measurement(
        suite="storage",
        name="small_files",
        value=Spread.of(samples).median,
        unit="files/s",
        method=f"{plan.jobs} threads, each opening, reading whole (readv to EOF) and closing its own "
        f"{files.per_job} files of {_size(files.file_bytes)} (random bytes), page cache dropped per file with "
        "posix_fadvise(DONTNEED) before each pass; MB = 10^6 bytes",
        device=common.get("source") or "",
        size={"files": files.per_job * files.jobs, "file_bytes": files.file_bytes, "jobs": plan.jobs},
        repeats=len(rates),
        spread=Spread.of(samples),
        extra={
            **common,
            "mb_per_s": Spread.of([r.mb_per_s for r in rates]).median,
            "pass_limit_s": plan.pass_limit_s,
            "fio_equivalent": shlex.join(fio_small_files_args(files, plan.pass_limit_s)),
        },
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------- the directory


def check_directory(path: str) -> str:
    """The absolute directory to test, or BadInput when it is missing or not a directory."""
    if not os.path.exists(path):
        raise BadInput(f"--path {path}: no such directory")
    if not os.path.isdir(path):
        raise BadInput(f"--path {path}: not a directory")
    return os.path.abspath(path)


def check_free_space(directory: str, plan: Plan) -> None:
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize  # what this user may write (root's reserve excluded)
    if free < plan.needed_bytes:
        raise BadInput(
            f"--path {directory}: {free / GiB:.2f} GiB free, the storage bench needs {plan.needed_bytes / GiB:.2f} GiB "
            f"(a {_size(plan.file_bytes)} test file and {plan.small_files} files of {_size(plan.small_file_bytes)}); "
            "try --quick or another --path"
        )


def filesystem_of(directory: str, snapshot: Snapshot | None = None, fs: SysFs | None = None) -> dict[str, Any]:
    """The mount holding ``directory`` (longest mountpoint prefixing its real path, as findmnt -T does):
    its type and source from /proc/self/mounts, and from the probe's snapshot whether it is a network or
    FUSE filesystem and what kind of disk is under it."""
    real = os.path.realpath(directory)
    holder = None
    for device, mountpoint, fstype in _mount_table(fs or SysFs("/")):
        under = mountpoint == "/" or real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/")
        if under and (holder is None or len(mountpoint) >= len(holder[1])):
            holder = (device, mountpoint, fstype)  # ties: the later mount hides the earlier
    if holder is None:
        return {"fstype": None, "mountpoint": None, "source": None}
    info: dict[str, Any] = {"fstype": holder[2], "mountpoint": holder[1], "source": holder[0]}
    if snapshot is not None:
        mount = next((m for m in snapshot.storage.mounts if m.mountpoint == holder[1]), None)
        if mount is not None:
            info.update(network=mount.network, fuse=mount.fuse, block_device=mount.block_device)
            disk = next((d for d in snapshot.storage.block_devices if d.name == mount.block_device), None)
            if disk is not None:
                info.update(disk_kind=disk.kind, disk_model=disk.model)
    return info


def _mount_table(fs: SysFs) -> list[tuple[str, str, str]]:
    r"""(source, mountpoint, fstype) per line of /proc/self/mounts; the kernel writes ' ' as '\040'."""
    rows = []
    for line in fs.read_lines("/proc/self/mounts"):
        fields = line.split()
        if len(fields) >= 3:
            rows.append((_unescape(fields[0]), _unescape(fields[1]), fields[2]))
    return rows


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), text)


def _create_error(directory: str, what: str, exc: OSError) -> BadInput:
    return BadInput(f"--path {directory}: cannot write {what} ({exc.strerror or exc})")


def _read_error(path: str, exc: OSError) -> RedlineError:
    return RedlineError(f"storage bench: reading {path} failed ({exc.strerror or exc})")


# ------------------------------------------------------------------------------ the test file


@dataclass
class TestFile:
    """The file the patterns read: ``direct`` when O_DIRECT reads work on it, else why not."""

    path: str
    size_bytes: int
    direct: bool = False
    no_direct: str | None = None
    # after the last cache drop: True (no page of it cached), False (some still were), None (could not tell)
    cache_dropped: bool | None = None

    __test__ = False  # a product class, not a pytest test class

    def slice_bytes(self, jobs: int) -> int:
        """Each reader's share, a whole number of the largest block so every pattern tiles it exactly."""
        return self.size_bytes // jobs // SEQ_READ.block_bytes * SEQ_READ.block_bytes

    def drop_cache(self) -> None:
        """Evict the file's pages from the page cache (clean pages only: it was fsynced when written)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self.cache_dropped = _none_cached(fd, self.size_bytes)
            # a probe that misses may start readahead: evict whatever it brought in before the pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.contextmanager
def test_file(directory: str, size_bytes: int, ctx: BenchContext | None = None) -> Iterator[TestFile]:
    """A ``size_bytes`` file of random bytes (incompressible, so no compressing or deduplicating
    filesystem can shortcut the reads), fsynced and evicted from the cache; removed on exit."""
    ctx = ctx or BenchContext()
    try:
        fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".dat", dir=directory)
    except OSError as exc:
        raise _create_error(directory, "a test file", exc) from None
    try:
        try:
            chunks = -(-size_bytes // FILL_CHUNK_BYTES)
            with ctx.task(f"storage: writing a {_size(size_bytes)} test file", chunks) as step:
                written = 0
                while written < size_bytes:
                    written += os.write(fd, os.urandom(min(FILL_CHUNK_BYTES, size_bytes - written)))
                    step()
            os.fsync(fd)  # dirty pages cannot be dropped from the cache; written-back ones can
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise _create_error(directory, f"a {_size(size_bytes)} test file", exc) from None
        finally:
            os.close(fd)
        tf = TestFile(path, size_bytes)
        tf.no_direct = _direct_read_fails(path)
        tf.direct = tf.no_direct is None
        yield tf
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _direct_read_fails(path: str) -> str | None:
    """None when an aligned O_DIRECT read works on ``path``; else the error. Some filesystems refuse the
    open (EINVAL), others accept it and fail the read, so both are tried."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        with _aligned_buffer(ALIGN_BYTES) as buf:
            os.preadv(fd, [buf], 0)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _aligned_buffer(nbytes: int) -> Iterator[mmap.mmap]:
    """Private anonymous mmap: page-aligned, which O_DIRECT needs and bytearray does not promise (fio's
    buffers are the same kind of memory: malloc'd, page-aligned)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        yield buf
    finally:
        buf.close()


def _none_cached(fd: int, size_bytes: int, probes: int = 32) -> bool | None:
    """Whether the page cache still holds the file, by RWF_NOWAIT reads at spread offsets: the kernel
    answers those only from the cache, failing with EAGAIN where the page would need the disk. None
    where the filesystem does not support the flag (or the file is empty)."""
    if size_bytes < ALIGN_BYTES:
        return None
    step = max(ALIGN_BYTES, size_bytes // probes // ALIGN_BYTES * ALIGN_BYTES)
    buf = bytearray(ALIGN_BYTES)
    # from the end backwards: readahead started by a miss runs forward, over offsets already probed
    for offset in reversed(range(0, size_bytes - ALIGN_BYTES + 1, step)):
        try:
            if os.preadv(fd, [buf], offset, os.RWF_NOWAIT) > 0:
                return False
        except BlockingIOError:
            continue
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return None
            raise
    return True


# ---------------------------------------------------------------------------------- the readers


def read_pass(tf: TestFile, pattern: Pattern, jobs: int, limit_s: float) -> Rate:
    """One timed pass of ``pattern``: ``jobs`` threads, each over its own slice of the file."""
    if not tf.direct:
        tf.drop_cache()
    slice_bytes = tf.slice_bytes(jobs)
    plans = []
    for job in range(jobs):
        offsets = list(range(job * slice_bytes, (job + 1) * slice_bytes, pattern.block_bytes))
        if pattern.random:
            random.shuffle(offsets)
        plans.append(offsets)
    flags = os.O_RDONLY | (os.O_DIRECT if tf.direct else 0)

    def reader(offsets: list[int], limit_s: float, stop: threading.Event) -> tuple[int, int]:
        fd = os.open(tf.path, flags)
        try:
            with _aligned_buffer(pattern.block_bytes) as buf:
                return _read_blocks(fd, buf, offsets, limit_s, stop)
        finally:
            os.close(fd)

    try:
        return _run_threads(reader, plans, limit_s)
    except OSError as exc:
        raise _read_error(tf.path, exc) from None


def _read_blocks(fd: int, buf: mmap.mmap, offsets: list[int], limit_s: float, stop: threading.Event) -> tuple[int, int]:
    """The inner loop: one blocking read at a time, as fio's psync engine; (bytes, reads)."""
    deadline = time.perf_counter() + limit_s
    nbytes = nreads = 0
    for offset in offsets:
        nbytes += os.preadv(fd, [buf], offset)
        nreads += 1
        if time.perf_counter() > deadline or stop.is_set():
            break
    return nbytes, nreads


def _run_threads(work: Callable[..., tuple[int, int]], plans: Sequence[Any], limit_s: float) -> Rate:
    """Run ``work(plan, limit_s, stop)`` on one thread per plan, started together; the rate is all
    bytes and ops over the span from the first start to the last finish. On Ctrl-C or an error the
    others are told to stop and are waited for, so no thread still holds a file when it is removed."""
    stop = threading.Event()
    barrier = threading.Barrier(len(plans))
    results: list[tuple[float, float, int, int] | None] = [None] * len(plans)
    errors: list[BaseException] = []

    def body(i: int, plan: Any) -> None:
        try:
            barrier.wait()
            t0 = time.perf_counter()
            nbytes, nops = work(plan, limit_s, stop)
            results[i] = (t0, time.perf_counter(), nbytes, nops)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            errors.append(exc)
            stop.set()
            barrier.abort()

    threads = [
        threading.Thread(target=body, args=(i, p), name=f"storage reader {i}", daemon=True) for i, p in enumerate(plans)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        barrier.abort()
        for t in threads:
            t.join(timeout=STOP_GRACE_S)  # told to stop, each ends within one read; a hung mount may not
    if errors:
        raise errors[0]
    done = [r for r in results if r is not None]
    span_s = max(r[1] for r in done) - min(r[0] for r in done)
    return Rate(sum(r[2] for r in done) / span_s, sum(r[3] for r in done) / span_s)


# ------------------------------------------------------------------------------ many small files


@dataclass
class SmallFiles:
    """``jobs`` x ``per_job`` files named as fio names its own (``small.<job>.<file>``), so fio can read
    exactly these files with --filename_format."""

    root: str
    jobs: int
    per_job: int
    file_bytes: int
    paths: list[list[str]] = field(default_factory=list)


@contextlib.contextmanager
def small_files(
    directory: str, count: int, file_bytes: int, jobs: int, ctx: BenchContext | None = None
) -> Iterator[SmallFiles]:
    """``count`` files of ``file_bytes`` random bytes in a temporary subdirectory, removed on exit."""
    ctx = ctx or BenchContext()
    try:
        root = tempfile.mkdtemp(prefix=TEMP_PREFIX, suffix=".small", dir=directory)
    except OSError as exc:
        raise _create_error(directory, "a test directory", exc) from None
    try:
        per_job = count // jobs
        files = SmallFiles(root, jobs, per_job, file_bytes)
        files.paths = [[os.path.join(root, f"small.{j}.{i}") for i in range(per_job)] for j in range(jobs)]
        # written in batches, jobs threads at a time, so progress and Ctrl-C are handled between batches
        batch = max(1, SMALL_FILES_PER_STEP // jobs)
        with ctx.task(f"storage: writing {per_job * jobs} files of {_size(file_bytes)}", -(-per_job // batch)) as step:
            for start in range(0, per_job, batch):
                try:
                    _run_threads(_write_files(file_bytes), [p[start : start + batch] for p in files.paths], 0.0)
                except OSError as exc:
                    raise _create_error(directory, "the small test files", exc) from None
                step()
        yield files
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _write_files(file_bytes: int) -> Callable[..., tuple[int, int]]:
    def write(paths: list[str], limit_s: float, stop: threading.Event) -> tuple[int, int]:
        for path in paths:
            if stop.is_set():
                break
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(file_bytes))
                os.fdatasync(fd)  # written back, so the cache drop before each pass can evict it
            finally:
                os.close(fd)
        return len(paths) * file_bytes, len(paths)

    return write


def small_files_pass(files: SmallFiles, limit_s: float) -> Rate:
    """One timed pass: each thread opens, reads whole and closes its files in turn, buffered, as a
    Dataset's __getitem__ does; the cache is dropped per file first so the pass reads the disk.

    The read is the plainest one (os.open, readv into a reused buffer until EOF, close: 4 syscalls);
    ``open(path, "rb").read()`` adds isatty, lseek and fstat calls and two objects per file, which cost
    ~7% of the rate on a 2-core VM: that is Python's overhead, not the filesystem's."""
    for paths in files.paths:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def reader(paths: list[str], limit_s: float, stop: threading.Event) -> tuple[int, int]:
        buf = bytearray(files.file_bytes + ALIGN_BYTES)  # one read takes the whole file, the next sees EOF
        deadline = time.perf_counter() + limit_s
        nbytes = nfiles = 0
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                while n := os.readv(fd, [buf]):
                    nbytes += n
            finally:
                os.close(fd)
            nfiles += 1
            if time.perf_counter() > deadline or stop.is_set():
                break
        return nbytes, nfiles

    try:
        return _run_threads(reader, files.paths, limit_s)
    except OSError as exc:
        raise _read_error(files.root, exc) from None


# -------------------------------------------------------------------------------------- fio


def fio_args(tf: TestFile, pattern: Pattern, jobs: int, limit_s: float) -> list[str]:
    """The fio job that does what ``read_pass`` does: psync (one blocking pread per job, iodepth 1, as
    each of our threads), the same block size, jobs, per-job slices, random map (each block at most
    once) with a new random sequence each run (as our shuffle; fio's default repeats one sequence, which
    a hypervisor's cache under a virtual disk then learns), the same time limit, O_DIRECT exactly when
    we use it, and the cache invalidated before the run when we do not."""
    slice_bytes = tf.slice_bytes(jobs)
    return [
        "fio",
        f"--name={pattern.name}",
        "--filename=" + tf.path.replace(":", "\\:"),  # fio splits file lists on ':'
        "--readonly",
        f"--rw={pattern.fio_rw}",
        "--randrepeat=0",
        f"--bs={pattern.block_bytes}",
        f"--numjobs={jobs}",
        f"--size={slice_bytes}",
        f"--offset_increment={slice_bytes}",
        "--ioengine=psync",
        f"--direct={int(tf.direct)}",
        "--invalidate=1",
        f"--runtime={round(limit_s * 1000)}ms",
        "--group_reporting",
        "--output-format=json",
    ]


def fio_small_files_args(files: SmallFiles, limit_s: float) -> list[str]:
    """fio reading the same small files: job j opens, reads and closes small.j.0, small.j.1, ... in
    turn (openfiles=1, sequential file service), one read of the whole file each, buffered."""
    return [
        "fio",
        "--name=small",
        f"--directory={files.root}",
        "--filename_format=$jobname.$jobnum.$filenum",
        f"--nrfiles={files.per_job}",
        f"--filesize={files.file_bytes}",
        f"--bs={files.file_bytes}",
        "--rw=read",
        f"--numjobs={files.jobs}",
        "--openfiles=1",
        "--file_service_type=sequential",
        "--readonly",
        "--ioengine=psync",
        "--direct=0",
        "--invalidate=1",
        f"--runtime={round(limit_s * 1000)}ms",
        "--group_reporting",
        "--output-format=json",
    ]


def run_fio(args: list[str]) -> Rate:
    """Run fio and read its group report: jobs[0].read.bw_bytes (B/s) and .iops."""
    done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RedlineError(f"fio failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}")
    read = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]["read"]
    return Rate(bytes_per_s=float(read["bw_bytes"]), ops_per_s=float(read["iops"]))
