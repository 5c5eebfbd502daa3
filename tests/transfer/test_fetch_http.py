"""redline fetch over HTTP against a real nginx (Debian's) on loopback: ranged chunks, resume after kill -9,
a corrupted byte detected, a file changed on the server, folders, bad input; and a server that drops
connections mid-chunk, for the retries."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import run_cli
from redline import transfer
from redline.transfer import journal
from redline.transfer.fetcher import BLOCK_BYTES as BLOCK
from transfer_servers import start_nginx, stop

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not shutil.which("nginx"), reason="needs nginx (apt-get install nginx-light)"),
]
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_saved_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's saved bench figures must not size the tests' transfers."""
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))


def _data(path: Path, size: int, seed: int = 0) -> bytes:
    data = hashlib.shake_256(f"{seed}".encode()).digest(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


@pytest.fixture
def nginx(tmp_path: Path):
    server = start_nginx(tmp_path, tmp_path / "www")
    yield server
    stop(server.process)


def test_a_file_arrives_whole_in_ranged_chunks_and_lands_only_when_complete(nginx, tmp_path: Path) -> None:
    data = _data(nginx.root / "big.bin", 10 * MiB + 123)
    dest = tmp_path / "out" / "big.bin"
    summary = transfer.fetch([f"{nginx.url}/big.bin"], dest, transfer.Options(streams=3, chunk_bytes=2 * MiB))
    assert [f.status for f in summary.files] == ["fetched"], summary.files
    assert dest.read_bytes() == data
    assert summary.files[0].sha256 == hashlib.sha256(data).hexdigest()
    # nothing of the transfer's state is left beside it, and its mtime is the server's Last-Modified
    assert sorted(p.name for p in dest.parent.iterdir()) == ["big.bin"]
    assert abs(dest.stat().st_mtime - (nginx.root / "big.bin").stat().st_mtime) < 1
    assert all(r["status"] == 206 for r in nginx.requests())
    spans = sorted(
        (int(a), int(b) + 1)
        for a, b in (
            r["range"].removeprefix("bytes=").split("-") for r in nginx.requests() if r["range"] != "bytes=0-0"
        )
    )
    # every byte asked for, in requests of whole blocks (the last block what is left), a chunk each but where a
    # stream's segment (14 blocks of 256 KiB: 41 over 3 streams) or the file ends
    covered = 0
    for a, b in spans:
        assert a <= covered and a % BLOCK == 0 and (b % BLOCK == 0 or b == len(data)), spans
        covered = max(covered, b)
    assert covered == len(data) and spans[0] == (0, 2 * MiB), spans
    # run again: the destination is already that file, so nothing moves
    again = transfer.fetch([f"{nginx.url}/big.bin"], dest)
    assert [f.status for f in again.files] == ["present"] and again.moved_bytes == 0


def test_kill_9_mid_transfer_then_resume_fetches_at_most_one_chunk_per_connection_again(tmp_path: Path) -> None:
    size, chunk, streams = 48 * MiB, 2 * MiB, 3
    # nginx lets each request burst one second's worth, then holds it to the rate: 512 KiB/s makes a 2 MiB chunk
    # take about 3 s, so the kill lands with chunks in flight; the resumed run gets a full-speed server
    slow = start_nginx(tmp_path / "slow", tmp_path / "www", rate="512k")
    fast = None
    try:
        data = _data(slow.root / "big.bin", size)
        dest = tmp_path / "big.bin"
        argv = [str(dest), "--streams", str(streams), "--chunk-size", "2M"]
        first = subprocess.Popen(
            [sys.executable, "-m", "redline", "fetch", f"{slow.url}/big.bin", *argv], stderr=subprocess.PIPE
        )
        done = _wait_for_chunks(journal.journal_path(dest), 2, first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert not dest.exists()

        fast = start_nginx(tmp_path / "fast", slow.root)
        result = run_cli("fetch", f"{fast.url}/big.bin", *argv, "--json")
        assert result.returncode == 0, result.stderr
        assert dest.read_bytes() == data
        assert _kept(result) >= done * BLOCK  # every recorded block was kept, none fetched again
        # all both servers sent, less the file: the blocks in flight at the kill (and one byte per run's stat),
        # within one chunk per connection
        wasted = slow.sent_bytes("/big.bin") + fast.sent_bytes("/big.bin") - size
        assert 0 <= wasted <= streams * chunk + 2, wasted
    finally:
        stop(slow.process)
        if fast is not None:
            stop(fast.process)


def _kept(result: subprocess.CompletedProcess[str]) -> int:
    import json

    return json.loads(result.stdout)["files"][0]["resumed_bytes"]


def _wait_for_chunks(path: Path, count: int, process: subprocess.Popen) -> int:
    """Chunks the journal records, once at least ``count`` are (bounded by the process ending, not a clock)."""
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) - 1 >= count:
            return len(lines) - 1
        assert process.poll() is None, process.stderr.read().decode()
        time.sleep(0.02)


def test_a_fetch_of_a_destination_another_process_is_fetching_waits_for_it(nginx, tmp_path: Path) -> None:
    """The lock a fetch holds on its destination, held here as another redline would: the second fetch says it
    waits, writes nothing meanwhile, and fetches the file once the lock is let go."""
    import json
    import queue

    from redline.lockfile import WriterLock

    data = _data(nginx.root / "shared.bin", 3 * MiB)
    dest = tmp_path / "out" / "shared.bin"
    dest.parent.mkdir()
    holder = WriterLock(journal.journal_path(dest), "download").acquire()
    second = subprocess.Popen(
        [sys.executable, "-m", "redline", "fetch", f"{nginx.url}/shared.bin", str(dest), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in second.stderr], daemon=True).start()
    try:
        told = lines.get(timeout=300)  # a hang guard: the line comes once the file is stat'ed
        assert f"pid {os.getpid()} is fetching it; waiting" in told and str(dest) in told, told
        assert not journal.part_path(dest).exists() and not dest.exists()
    finally:
        holder.release()
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, list(lines.queue)
    assert json.loads(out)["files"][0]["status"] == "fetched"
    assert dest.read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["shared.bin"]  # no lock file left beside it


def test_a_destination_whose_lock_cannot_be_made_fails_that_file_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "src.txt"
    source.write_text("hi")
    dest = tmp_path / ("a" * 240)  # a name the filesystem takes, its lock's name (+21 characters) not
    result = run_cli("fetch", str(source), str(dest))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "File name too long" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not dest.exists()


def test_a_server_that_refuses_connections_is_one_line_and_exit_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_cli("fetch", f"http://127.0.0.1:{port}/x.bin", str(tmp_path / "x.bin"), "--retries", "0")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "refused" in lines[0], result.stderr
    assert "internal error" not in result.stderr


def test_a_corrupted_byte_on_the_server_is_detected_and_nothing_lands(nginx, tmp_path: Path) -> None:
    source = nginx.root / "model.pt"
    data = _data(source, 3 * MiB)
    good = hashlib.sha256(data).hexdigest()
    stamp = source.stat()
    with open(source, "r+b") as f:  # one byte flipped in place; size and mtime kept, so the ETag is unchanged
        f.seek(1_234_567)
        byte = f.read(1)
        f.seek(1_234_567)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    dest = tmp_path / "model.pt"
    result = run_cli("fetch", f"{nginx.url}/model.pt", str(dest), "--checksum", f"sha256:{good}")
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[0]
    assert "SHA-256" in line and good in line and "nothing was written" in line
    assert not dest.exists() and not journal.part_path(dest).exists()


def test_a_file_replaced_on_the_server_between_runs_is_fetched_anew(nginx, tmp_path: Path) -> None:
    source = nginx.root / "data.bin"
    _data(source, 4 * MiB, seed=1)
    dest = tmp_path / "data.bin"
    remote = transfer.source.Remote(f"{nginx.url}/data.bin", 4 * MiB, None, source.stat().st_mtime)
    # an earlier run's state: two chunks recorded for the old file
    state = journal.Journal.open(journal.landing(dest), remote, MiB)
    state.record(0, "0" * 64)
    state.close()
    new = _data(source, 5 * MiB, seed=2)
    summary = transfer.fetch([f"{nginx.url}/data.bin"], dest, transfer.Options(chunk_bytes=MiB))
    assert summary.files[0].status == "fetched" and dest.read_bytes() == new
    assert "started anew" in summary.files[0].note and "size" in summary.files[0].note


def test_a_range_guarded_by_its_etag_refuses_a_file_changed_mid_transfer(nginx, tmp_path: Path) -> None:
    from redline.transfer.http import HttpSource, Pools
    from redline.transfer.source import Changed, Sockets

    source = nginx.root / "x.bin"
    _data(source, 2 * MiB, seed=3)
    http = HttpSource(f"{nginx.url}/x.bin", Pools(Sockets(), 4))
    remote = http.stat()
    assert remote.etag and remote.ranged
    _data(source, 2 * MiB, seed=4)
    os.utime(source, (time.time() + 10, time.time() + 10))  # a new mtime: nginx's ETag changes with it
    with pytest.raises(Changed, match="changed on the server"):
        http.read(remote, MiB, 2 * MiB, lambda piece: None)


def test_several_files_and_folders_land_under_a_directory(nginx, tmp_path: Path) -> None:
    a = _data(nginx.root / "a.bin", 300_000, seed=5)
    b = _data(nginx.root / "sub" / "b.bin", 0)
    local = tmp_path / "local"
    c = _data(local / "deep" / "c.bin", 70_000, seed=6)
    dest = tmp_path / "dest"
    urls = [f"{nginx.url}/a.bin", f"{nginx.url}/sub/b.bin", f"{local}/"]
    summary = transfer.fetch(urls, dest)
    assert [f.status for f in summary.files] == ["fetched"] * 3
    assert (dest / "a.bin").read_bytes() == a and (dest / "b.bin").read_bytes() == b
    assert (dest / "deep" / "c.bin").read_bytes() == c
    # a destination that exists and is another file is kept unless --overwrite
    (dest / "a.bin").write_bytes(b"mine")
    kept = transfer.fetch([f"{nginx.url}/a.bin"], dest)
    assert kept.files[0].status == "failed" and "--overwrite" in kept.files[0].error
    assert (dest / "a.bin").read_bytes() == b"mine"
    replaced = transfer.fetch([f"{nginx.url}/a.bin"], dest, transfer.Options(overwrite=True))
    assert replaced.files[0].status == "fetched" and (dest / "a.bin").read_bytes() == a


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Serves one file with ranges; the first ``drops`` ranged GETs send ``cut`` of their bytes and hang up."""

    data = b""
    drops = 0
    cut = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        start, end = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        body = self.data[start : end + 1]
        with self.lock:
            drop = type(self).drops > 0 and len(body) > 1
            type(self).drops -= drop
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"v1"')
        self.end_headers()
        self.wfile.write(body[: self.cut] if drop else body)
        if drop:
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


def test_a_connection_dropped_mid_chunk_is_retried_and_the_bytes_counted_once(tmp_path: Path) -> None:
    # each drop mid-block: the blocks before it are kept, the partial one comes again
    _Flaky.data, _Flaky.drops, _Flaky.cut = hashlib.shake_256(b"flaky").digest(6 * MiB), 3, 2 * BLOCK + 100_000
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/f.bin"
        seen = []

        class Counting(transfer.Progress):
            def advance(self, size: int) -> None:
                seen.append(size)

        options = transfer.Options(streams=2, chunk_bytes=MiB, retries=5)
        summary = transfer.fetch([url], tmp_path / "f.bin", options, progress=Counting())
    finally:
        server.shutdown()
    result = summary.files[0]
    assert result.status == "fetched" and (tmp_path / "f.bin").read_bytes() == _Flaky.data
    assert result.retries == 3
    assert sum(seen) == 6 * MiB  # the progress took back each dropped chunk's bytes
    assert result.moved_bytes == 6 * MiB + 3 * 100_000  # what came over the wire, the partial blocks too


def test_a_missing_file_and_bad_options_are_one_line(nginx, tmp_path: Path) -> None:
    missing = run_cli("fetch", f"{nginx.url}/nope.bin", str(tmp_path / "x"))
    assert missing.returncode == 1 and missing.stderr.strip() == f"redline: {nginx.url}/nope.bin: HTTP 404 Not Found"
    for argv, needle in [
        ([f"{nginx.url}/a"], "one source and a destination"),
        ([f"{nginx.url}/a", "x", "--checksum", "md5:12"], "not a SHA-256"),
        ([f"{nginx.url}/a", "x", "--streams", "0"], "--streams"),
        ([f"{nginx.url}/a", "x", "--chunk-size", "lots"], "--chunk-size"),
        ([f"{nginx.url}/", "x"], "no listing"),
    ]:
        result = run_cli("fetch", *argv, cwd=tmp_path)
        assert result.returncode == 2, (argv, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (argv, result.stderr)


def test_many_files_need_no_descriptor_each(tmp_path: Path) -> None:
    """500 files under a limit of 64 open files: descriptors are held per chunk in flight, not per file."""
    import resource

    source = tmp_path / "many"
    for i in range(500):
        _data(source / f"{i:03}.bin", 1000 + i, seed=i)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    result = subprocess.run(
        [sys.executable, "-m", "redline", "fetch", f"{source}/", str(tmp_path / "copy"), "--json"],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env=dict(os.environ),
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(p.name for p in source.iterdir())
    assert (tmp_path / "copy" / "499.bin").read_bytes() == (source / "499.bin").read_bytes()


def test_ctrl_c_stops_at_once_and_keeps_what_arrived(tmp_path: Path) -> None:
    server = start_nginx(tmp_path, tmp_path / "www", rate="256k")  # after a 1 s burst: 4 s per 1 MiB chunk
    try:
        data = _data(server.root / "slow.bin", 64 * MiB)
        dest = tmp_path / "slow.bin"
        argv = [f"{server.url}/slow.bin", str(dest), "--streams", "4", "--chunk-size", "1M"]
        first = subprocess.Popen([sys.executable, "-m", "redline", "fetch", *argv], stderr=subprocess.PIPE, text=True)
        _wait_for_chunks(journal.journal_path(dest), 2, first)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)  # a hang guard: 60 chunks were left to fetch
        assert first.returncode == 130 and err.strip().splitlines()[-1] == "redline: interrupted", err
        assert not dest.exists() and journal.part_path(dest).exists()
        # the rest, through the server at full speed
        stop(server.process)
        server = start_nginx(tmp_path / "fast", server.root)
        argv[0] = f"{server.url}/slow.bin"
        result = run_cli("fetch", *argv)
        assert result.returncode == 0, result.stderr
        assert dest.read_bytes() == data
    finally:
        stop(server.process)
