"""The storage bench: bad paths are refused with one line, nothing is ever left behind, the figures are
sane at small sizes, and redline's reader agrees with fio on the same file."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from redline.bench import storage
from redline.bench.context import BenchContext
from redline.bench.storage import KiB, MiB, Plan
from redline.errors import BadInput
from redline.hw.sysfs import SysFs

pytestmark = pytest.mark.system

# small enough for a 2-core CI runner: a 16 MiB file, 40 small files, 2 repeats of <= 0.2 s per pattern
TINY = Plan(file_bytes=16 * MiB, small_files=40, small_file_bytes=16 * KiB, jobs=2, repeats=2, pass_limit_s=0.2)


def _left_in(directory) -> list[str]:
    return sorted(os.listdir(directory))


# ----------------------------------------------------------------------------------- bad paths


def test_missing_path_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="no such directory"):
        storage.measure(str(tmp_path / "nope"), TINY)


def test_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(BadInput, match="not a directory"):
        storage.measure(str(tmp_path / "f"), TINY)
    assert _left_in(tmp_path) == ["f"]


def test_not_enough_free_space_says_the_numbers(tmp_path):
    huge = Plan(file_bytes=2**50, small_files=4, small_file_bytes=4 * KiB, jobs=2, repeats=1, pass_limit_s=0.1)
    with pytest.raises(BadInput, match=r"GiB free, the storage bench needs \d+\.\d\d GiB"):
        storage.measure(str(tmp_path), huge)
    assert _left_in(tmp_path) == []


def test_unwritable_directory_error_mapping(tmp_path, monkeypatch):
    """The mapping from the OS error to one line, with the file creation failing as on a read-only
    filesystem (monkeypatched: the real thing is the next test, which needs a mount namespace)."""

    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(storage.tempfile, "mkstemp", refuse)
    with pytest.raises(BadInput, match=r"cannot write a test file \(Read-only file system\)"):
        storage.measure(str(tmp_path), TINY)
    assert _left_in(tmp_path) == []


def test_read_only_directory_through_the_cli(tmp_path):
    """A really read-only directory. Root ignores permission bits, so as root the directory is bind-
    mounted read-only onto itself inside a private mount namespace (`unshare -m`), which vanishes with
    the process and never touches the host's mounts; as another user, chmod 0o555 is enough."""
    target = tmp_path / "ro"
    target.mkdir()
    cli = [sys.executable, "-m", "redline", "bench", "storage", "--quick", "--path", str(target)]
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: no honest way to make a read-only directory")
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" || exit 99; shift; exec "$@"'
        cmd = ["unshare", "-m", "sh", "-c", script, "sh", str(target), *cli]
    else:
        target.chmod(0o555)
        cmd = cli
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode == 99 or "unshare failed" in done.stderr:
        pytest.skip(f"no private mount namespace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert f"--path {target}: cannot write a test file" in message
    assert "Read-only file system" in message or "Permission denied" in message
    target.chmod(0o755)
    assert _left_in(target) == []


# ------------------------------------------------------------------------ nothing left behind


@pytest.mark.parametrize(
    "stage",
    ["writing a 16 MiB test file", "storage rand_read_4k", "writing 40 files", "storage small_files"],
)
def test_interrupt_at_any_stage_leaves_nothing(tmp_path, stage):
    """Ctrl-C (KeyboardInterrupt) raised from the progress callback while each stage runs."""

    def progress(description, completed, total):
        if stage in description and completed == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        storage.measure(str(tmp_path), TINY, BenchContext(progress=progress))
    assert _left_in(tmp_path) == []


def test_sigint_while_threads_read_leaves_nothing(tmp_path, monkeypatch):
    """A real SIGINT to this process while the main thread waits on the reader threads: the readers
    are told to stop and waited for, then the test file is removed."""

    real_read = storage._read_blocks
    sent = threading.Event()

    def read_then_interrupt(fd, buf, offsets, limit_s, stop):
        # the first reader of the random pass sends the signal itself, so it lands while the readers run
        # however late a loaded machine schedules anything (a timer could fire after the pass)
        if len(buf) == 4 * KiB and not sent.is_set():
            sent.set()
            os.kill(os.getpid(), signal.SIGINT)
        return real_read(fd, buf, offsets, limit_s, stop)

    monkeypatch.setattr(storage, "_read_blocks", read_then_interrupt)
    plan = Plan(file_bytes=64 * MiB, small_files=4, small_file_bytes=4 * KiB, jobs=2, repeats=3, pass_limit_s=5.0)
    with pytest.raises(KeyboardInterrupt):
        storage.measure(str(tmp_path), plan, BenchContext())
    assert sent.is_set()
    assert _left_in(tmp_path) == []
    # a joined thread can linger in enumerate() for an instant after it stopped: only live ones count
    assert not [t for t in threading.enumerate() if t.name.startswith("storage reader") and t.is_alive()]


def test_read_error_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_read(fd, buf, offsets, limit_s, stop):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(storage, "_read_blocks", failing_read)
    with pytest.raises(storage.RedlineError, match=r"reading .*redline-bench-.* failed \(Input/output error\)"):
        storage.measure(str(tmp_path), TINY)
    assert _left_in(tmp_path) == []


def test_sigint_to_the_cli_leaves_nothing(tmp_path):
    """A real Ctrl-C: SIGINT to `redline bench storage` while it writes or reads; exit 130, dir empty."""
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "redline", "bench", "storage", "--quick", "--json", "--path", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # wait for the bench to create its test file, however long a loaded machine takes to get there (the bound
    # only catches a hang); then interrupt it while it writes or reads
    deadline = time.monotonic() + 600
    while not _left_in(tmp_path) and proc.poll() is None:
        assert time.monotonic() < deadline, "the bench never created its test file"
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in (1, 130), err  # the CLI's interrupt exit (typer may answer Ctrl-C itself)
    assert "Traceback" not in err
    assert _left_in(tmp_path) == []


# ---------------------------------------------------------------------------------- the figures


def test_small_run_measures_every_pattern(tmp_path):
    measurements = storage.measure(str(tmp_path), TINY)
    assert [m.name for m in measurements] == ["seq_read", "rand_read_4k", "rand_read_128k", "small_files"]
    assert [m.unit for m in measurements] == ["MB/s", "IOPS", "MB/s", "files/s"]
    for m in measurements:
        assert m.value > 0 and m.repeats == 2 and m.spread.minimum <= m.value <= m.spread.maximum
        assert m.peak is None  # no datasheet for a filesystem
        assert m.extra["path"] == str(tmp_path) and m.extra["fstype"]
        assert m.extra["mb_per_s"] > 0 and "MB = 10^6" in m.method
    seq, rand4k = measurements[0], measurements[1]
    assert seq.size == {"file_bytes": 16 * MiB, "block_bytes": MiB, "jobs": 2}
    assert rand4k.extra["iops"] == rand4k.value
    assert rand4k.extra["mb_per_s"] == pytest.approx(rand4k.value * 4096 / 1e6)
    assert measurements[3].extra["mb_per_s"] == pytest.approx(measurements[3].value * 16 * KiB / 1e6)
    assert _left_in(tmp_path) == []


def test_without_o_direct_the_cache_is_dropped(tmp_path, monkeypatch):
    """Where O_DIRECT fails, each pass first evicts the file with posix_fadvise(DONTNEED); the
    RWF_NOWAIT check confirms it (on ext4/xfs/btrfs; tmpfs keeps files in RAM, so it cannot)."""
    monkeypatch.setattr(storage, "_direct_read_fails", lambda path: "Invalid argument")
    with storage.test_file(str(tmp_path), 8 * MiB) as tf:
        assert not tf.direct
        storage.read_pass(tf, storage.SEQ_READ, 2, 1.0)  # the whole file is now in the cache
        tf.drop_cache()
        fstype = storage.filesystem_of(str(tmp_path))["fstype"]
        if fstype in ("ext4", "xfs", "btrfs"):
            assert tf.cache_dropped is True
        rate = storage.read_pass(tf, storage.SEQ_READ, 2, 1.0)
        assert rate.bytes_per_s > 0
    (m,) = [
        m
        for m in storage.measure(str(tmp_path), Plan(8 * MiB, 8, 4 * KiB, jobs=2, repeats=1, pass_limit_s=0.1))
        if m.name == "seq_read"
    ]
    assert "posix_fadvise(DONTNEED) before each pass (O_DIRECT: Invalid argument)" in m.method
    assert m.extra["direct_io"] is False and "--direct=0" in m.extra["fio_equivalent"]


def test_filesystem_is_the_longest_mount_prefix(tmp_path):
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mounts").write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /data tmpfs rw 0 0\n"
        "srv:/export /data/my\\040set nfs4 rw 0 0\n"
        "/dev/nvme0n1p1 /data ext4 rw 0 0\n"  # mounted later on /data: hides the tmpfs
    )
    fs = SysFs(root)
    assert storage.filesystem_of("/data/my set/train", fs=fs)["fstype"] == "nfs4"
    assert storage.filesystem_of("/data/my setx", fs=fs) == {
        "fstype": "ext4",
        "mountpoint": "/data",
        "source": "/dev/nvme0n1p1",
    }
    assert storage.filesystem_of("/home", fs=fs)["mountpoint"] == "/"


def test_fio_command_matches_our_pattern():
    tf = storage.TestFile("/data/a:b.dat", 64 * MiB, direct=True)
    args = storage.fio_args(tf, storage.RAND_READ_128K, 4, 1.5)
    for expected in (
        "--filename=/data/a\\:b.dat",
        "--rw=randread",
        "--bs=131072",
        "--numjobs=4",
        "--size=16777216",
        "--offset_increment=16777216",
        "--ioengine=psync",
        "--direct=1",
        "--runtime=1500ms",
        "--output-format=json",
    ):
        assert expected in args


# ------------------------------------------------------------------------------- against fio


def _paired_ratio(tf, pattern, *, rounds: int, jobs: int, limit_s: float) -> float:
    """Median over rounds of redline/fio for passes run back to back (alternating which goes first):
    the disk's speed drifts over seconds, so each redline pass is compared with the fio pass next to it.
    Operations per second: for one block size the same ratio as bytes per second."""
    ratios = []
    for r in range(rounds):
        rates = {}
        for tool in ("fio", "redline") if r % 2 == 0 else ("redline", "fio"):
            if tool == "fio":
                rates[tool] = storage.run_fio(storage.fio_args(tf, pattern, jobs, limit_s))
            else:
                rates[tool] = storage.read_pass(tf, pattern, jobs, limit_s)
        ratios.append(rates["redline"].ops_per_s / rates["fio"].ops_per_s)
    return statistics.median(ratios)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (CI installs it: apt-get install fio)")
def test_agrees_with_fio_on_the_same_file(tmp_path):
    """Short version of benchmarks/storage_vs_fio.py: fio and redline back to back on one file.

    The issue's target is redline/fio within 10%; the full benchmark (15 rounds of <= 2 s on a 1 GiB
    file) checks that, and its medians land within a few percent here. This CI version has ~18 s: 5
    rounds of <= 0.4 s per pattern on a 2-core VM whose virtual disk is shared with other tenants, where
    single passes of the *same* tool scatter by -30%..+60% from one second to the next (the p10-p90 the
    benchmark prints). Over repeated runs here the median of 5 paired ratios ranged 0.76-1.07 on an idle
    machine, and fell to 0.60 with the test suite and two CPU hogs beside it (redline's reader threads are
    Python's, fio's are C: CPU contention costs redline more). So the band is a factor of 2 either way: honest
    for that noise under load, and still clear of what a broken reader gives (answered from the page cache
    5-10x, the 4 threads serialised 4x, 4 KiB blocks for 128 KiB ones far more).
    """
    with storage.test_file(str(tmp_path), 384 * MiB) as tf:
        ratios = {
            pattern.name: _paired_ratio(tf, pattern, rounds=5, jobs=4, limit_s=0.4) for pattern in storage.PATTERNS
        }
    assert _left_in(tmp_path) == []
    print("redline/fio:", {name: round(ratio, 3) for name, ratio in ratios.items()})
    for name, ratio in ratios.items():
        assert 1 / 2 <= ratio <= 2, f"{name}: redline/fio = {ratio:.2f} (all: {ratios})"
