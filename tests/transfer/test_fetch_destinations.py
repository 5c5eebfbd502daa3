"""Where a fetch writes, on a shared server: links another user plants beside DEST in a shared sticky folder,
a device node or a FIFO as DEST or as the source, a disk too small or filled mid-fetch (a small tmpfs mounted
for the test), and the streams a host can run. Each as a user meets it: the CLI, off a terminal, 80 columns."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import run_cli
from redline import transfer
from redline.errors import BadInput
from redline.transfer import journal
from small_disk import small_disk
from transfer_servers import HostileServer, Misbehaviour
from unix_users import as_user

pytestmark = pytest.mark.system

MiB = 1 << 20
NARROW = {"COLUMNS": "80"}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second user, mount, mknod)")


@pytest.fixture(autouse=True)
def _no_saved_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))


def _bytes(size: int, seed: int) -> bytes:
    return hashlib.shake_256(f"dest-{seed}".encode()).digest(size)


def _one_line(result, code: int) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture
def server():
    serving = HostileServer(_bytes(2 * MiB, 1), Misbehaviour())  # a well-behaved one: ranges, ETag
    yield serving
    serving.close()


@pytest.fixture
def shared():
    """A shared sticky folder, as /tmp is: anyone may make names in it, only their owner remove them."""
    folder = Path(tempfile.mkdtemp(prefix="redline-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _plant(uid: int, links: dict[Path, Path]) -> None:
    """Symlinks made by the user ``uid`` (a child process that became it), each name -> target."""

    def plant() -> None:
        for name, target in links.items():
            os.symlink(target, name)

    as_user(uid, plant)


def _victims(folder: Path, count: int) -> list[Path]:
    """Files of root's, each with bytes of its own, that a fetch must never touch."""
    out = []
    for i in range(count):
        path = folder / f"root-file-{i}"
        path.write_bytes(f"root's file {i}\n".encode() * 100)
        path.chmod(0o600)
        out.append(path)
    return out


@root_only
def test_links_another_user_plants_beside_dest_are_never_followed(server, other_user: int, shared: Path, tmp_path):
    """The part file and journal's names, planted as links to two files of root's: the fetch removes the links,
    makes its own files, and lands; root's files keep every byte."""
    victims = _victims(tmp_path, 2)
    dest = shared / "model.bin"
    _plant(other_user, {journal.part_path(dest): victims[0], journal.journal_path(dest): victims[1]})
    result = run_cli("fetch", server.url, str(dest), "--streams", "2", "--chunk-size", "256K", env=NARROW)
    assert result.returncode == 0, result.stderr
    assert dest.read_bytes() == server.data and not dest.is_symlink()
    for i, victim in enumerate(victims):
        assert victim.read_bytes() == f"root's file {i}\n".encode() * 100
    assert sorted(p.name for p in shared.iterdir()) == ["model.bin"]


def test_a_hard_link_at_the_part_file_s_name_is_not_taken_up(server, tmp_path: Path) -> None:
    """An earlier run's journal, and at the part file's name a hard link to another file of this user's that
    holds the same bytes (where the folder lets another user make it, and protected_hardlinks is off, they can):
    the fetch makes its own part file, and the linked file keeps its bytes."""
    data, dest = server.data, tmp_path / "model.bin"
    remote = transfer.source.Remote(server.url, len(data), '"v1"', 1704067200.0, ranged=True)
    state = journal.Journal.open(journal.landing(dest), remote, 256 * 1024)
    with open(journal.part_path(dest), "r+b") as part:
        part.write(data[: 256 * 1024])
    state.record(0, hashlib.sha256(data[: 256 * 1024]).hexdigest())
    mine = tmp_path / "elsewhere.bin"  # a file of this user's, linked in where the part file was
    os.replace(journal.part_path(dest), mine)
    kept = mine.read_bytes()
    os.link(mine, journal.part_path(dest))
    result = run_cli("fetch", server.url, str(dest), "--chunk-size", "256K", env=NARROW)
    assert result.returncode == 0, result.stderr
    assert dest.read_bytes() == data and mine.read_bytes() == kept and mine.stat().st_nlink == 1


@root_only
def test_a_planted_lock_link_and_a_planted_dest_link_are_refused_in_one_line(
    server, other_user: int, shared: Path, tmp_path: Path
) -> None:
    victims = _victims(tmp_path, 2)
    locked, linked = shared / "a.bin", shared / "b.bin"
    _plant(other_user, {Path(f"{journal.journal_path(locked)}.lock"): victims[0], linked: victims[1]})
    refused = run_cli("fetch", server.url, str(locked), env=NARROW)
    line = _one_line(refused, 1)
    assert "a.bin.redline-journal.lock" in line, line
    for argv in ([], ["--overwrite"]):
        through = run_cli("fetch", server.url, str(linked), *argv, env=NARROW)
        line = _one_line(through, 2)
        assert "symlink" in line and "--overwrite" not in line, line
    for i, victim in enumerate(victims):
        assert victim.read_bytes() == f"root's file {i}\n".encode() * 100
    assert not locked.exists() and linked.is_symlink()


@root_only
def test_a_device_node_as_dest_is_refused_even_with_overwrite(server, tmp_path: Path) -> None:
    """A character device like /dev/null, made here (replacing the real one would break the machine)."""
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:  # a container without CAP_MKNOD
        pytest.skip("cannot make a device node here")
    for argv in ([], ["--overwrite"]):
        result = run_cli("fetch", server.url, str(device), *argv, env=NARROW)
        line = _one_line(result, 2)
        assert "character device" in line and "--overwrite" not in line, line
        assert stat.S_ISCHR(os.lstat(device).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]  # no part file, journal or lock made beside it


def test_a_fifo_or_a_device_as_the_source_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for source, kind in [(fifo, "FIFO"), (Path("/dev/zero"), "character device"), (Path("/dev/null"), "device")]:
        result = run_cli("fetch", str(source), str(tmp_path / "copy"), env=NARROW, timeout=300)  # a hang guard
        line = _one_line(result, 2)
        assert kind in line and str(source) in line, line
        assert not (tmp_path / "copy").exists()


@root_only
def test_a_disk_too_small_fails_the_file_before_a_byte_moves(server, tmp_path: Path) -> None:
    with small_disk(tmp_path / "small", "1m") as disk:
        result = run_cli("fetch", server.url, str(disk / "file.bin"), env=NARROW)
        line = _one_line(result, 1)
        assert "needs 2.0 MiB free" in line and "nothing was fetched" in line, line
        assert list(disk.iterdir()) == [] and server.gets == 1  # the stat alone


@root_only
def test_a_disk_filled_mid_fetch_fails_at_once_and_keeps_what_was_verified(server, tmp_path: Path) -> None:
    """Another writer fills the disk after the first blocks land: the file fails at once (no retries), its
    verified blocks stay, and once there is room again a run resumes from them."""
    with small_disk(tmp_path / "small", "3m") as disk:
        filler = disk / "filler"

        class FillAfterFirstBlocks(transfer.Progress):
            moved = 0

            def advance(self, size: int) -> None:
                self.moved += size
                if self.moved > 600 << 10 and not filler.exists():  # two blocks of 256 KiB landed
                    with open(filler, "wb") as f, contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * 65536)

        dest = disk / "file.bin"
        options = transfer.Options(streams=1, chunk_bytes=256 << 10)
        first = transfer.fetch([server.url], dest, options, progress=FillAfterFirstBlocks()).files[0]
        assert first.status == "failed" and first.retries == 0, first
        assert "disk is full" in first.error and "run again to resume" in first.error, first.error
        assert journal.part_path(dest).exists() and journal.journal_path(dest).exists()
        filler.unlink()
        again = transfer.fetch([server.url], dest, options).files[0]
        assert again.status == "fetched" and again.resumed_bytes > 0, again
        assert dest.read_bytes() == server.data


def test_streams_past_what_the_host_runs_are_refused_by_the_cli_and_the_library(tmp_path: Path) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(b"x" * 1000)

    def few_files() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    for verb, option in [("fetch", "--streams"), ("fetch", "--per-endpoint"), ("push", "--streams")]:
        result = subprocess.run(
            [sys.executable, "-m", "redline", verb, str(source), str(tmp_path / "copy.bin"), option, "100"],
            capture_output=True,
            text=True,
            preexec_fn=few_files,
            env=dict(os.environ, **NARROW),
            timeout=300,
        )
        line = _one_line(result, 2)
        assert f"{option} must be between 1 and 16" in line and "ulimit -n" in line, line
    assert not (tmp_path / "copy.bin").exists()
    for field, value, words in [
        ("streams", 5000, "--streams must be between 1 and"),
        ("per_endpoint", 0, "--per-endpoint must be between 1 and"),
        ("retries", -1, "--retries must be between 0 and"),
        ("chunk_bytes", 1, "--chunk-size must be between 64K and"),
    ]:
        with pytest.raises(BadInput, match=words):
            transfer.Options(**{field: value})
