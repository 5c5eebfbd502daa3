"""The stage cache and the Staged reader against a real nginx (Debian's): LRU eviction under the cap, one
fetch for two processes staging one URL, pinned entries kept, the reader fetching ahead, tar shards, failures
named by URL, bad input; and, on an emulated 200 ms link, a training loop under redline.prepare() that waits
on the network only for its first shard when it reads through Staged, where reading straight does not."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import run_cli
from redline.errors import BadInput
from redline.transfer.cache import Cache, NotStageable, StageError, key_of
from redline.transfer.stage import Staged, split_name
from transfer_servers import start_nginx, stop

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not shutil.which("nginx"), reason="needs nginx (apt-get install nginx-light)"),
]
MiB = 1 << 20
HANG_S = 120.0  # a hang guard only: what the tests wait for is an event
HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _no_saved_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's saved bench figures must not size the transfers; the default cache is the test's."""
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))


@pytest.fixture
def nginx(tmp_path: Path):
    server = start_nginx(tmp_path, tmp_path / "www")
    yield server
    stop(server.process)


def _file(root: Path, name: str, size: int) -> bytes:
    data = os.urandom(size)
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(data)
    return data


def _tar(root: Path, name: str, members: dict[str, bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / name, "w") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _body_bytes(server, uri: str) -> int:
    """What nginx sent of ``uri`` in ranged GETs, leaving out the one-byte stats (``bytes=0-0``)."""
    return sum(r["sent"] for r in server.requests() if r["uri"] == uri and r["range"] != "bytes=0-0")


def _until(condition, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited before {what}: {process.stderr.read() if process.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {HANG_S:.0f} s")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------- the cache


def test_least_recently_used_entries_go_first_and_the_cache_stays_under_its_cap(nginx, tmp_path: Path) -> None:
    for name in "abcd":
        _file(nginx.root, name, MiB)
    cache = Cache(tmp_path / "cache", max_bytes=3 * MiB + MiB // 2)  # three fit
    for name in "abc":
        with cache.get(f"{nginx.url}/{name}") as pinned:
            assert pinned.fetched and pinned.path.read_bytes() == (nginx.root / name).read_bytes()
    with cache.get(f"{nginx.url}/a") as pinned:  # a is used again: b is now the least recently used
        assert not pinned.fetched
    cache.get(f"{nginx.url}/d").close()
    assert [e.url.rsplit("/", 1)[1] for e in cache.entries()] == ["c", "a", "d"]
    assert sum(e.size_bytes for e in cache.entries()) <= cache.max_bytes()
    assert not any(p.name.startswith(key_of(f"{nginx.url}/b")) for p in cache.entries_dir.iterdir())
    assert _body_bytes(nginx, "/a") == MiB  # fetched once, used twice
    # lowering the cap evicts at once, least recently used first
    Cache(tmp_path / "cache", max_bytes=2 * MiB)
    assert [e.url.rsplit("/", 1)[1] for e in cache.entries()] == ["a", "d"]


def test_an_entry_larger_than_the_whole_cache_is_refused_in_one_line(nginx, tmp_path: Path) -> None:
    _file(nginx.root, "big", 2 * MiB)
    result = run_cli("stage", "add", f"{nginx.url}/big", "--cache", str(tmp_path / "c"), "--max-size", "1M")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"redline: {nginx.url}/big: 2.0 MiB is more than the whole cache holds (1.0 MiB at {tmp_path / 'c'}); "
        "raise --max-size"
    ]
    assert _body_bytes(nginx, "/big") == 0


def _nginx_workers(server) -> list[int]:
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def _waits_on_a_lock(pid: int) -> bool:
    """Whether ``pid`` is blocked in flock (a "->" line of /proc/locks names the waiters)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return any(line.split()[1] == "->" and str(pid) in line.split() for line in lines)


def test_two_processes_staging_one_url_fetch_it_once(tmp_path: Path) -> None:
    server = start_nginx(tmp_path, tmp_path / "www", rate="1m")
    workers = _nginx_workers(server)
    try:
        data = _file(server.root, "shard.tar", 3 * MiB)
        url, cache = f"{server.url}/shard.tar", tmp_path / "cache"
        argv = [sys.executable, "-m", "redline", "stage", "add", url, "--cache", str(cache)]
        first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        meta = cache / "entries" / f"{key_of(url)}.json"
        _until(lambda: meta.exists() and json.loads(meta.read_text())["state"] == "filling", "fill", first)
        for pid in workers:  # the first one's fill stalls here, mid-transfer, until the second waits on it
            os.kill(pid, signal.SIGSTOP)
        try:
            second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _until(lambda: _waits_on_a_lock(second.pid), "second process waiting on the fill", second)
            assert first.poll() is None
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        out_first, err_first = first.communicate(timeout=HANG_S)
        out_second, err_second = second.communicate(timeout=HANG_S)
        assert first.returncode == 0 and second.returncode == 0, (err_first, err_second)
        assert out_first.startswith("fetched:") and out_second.startswith("already staged:"), (out_first, out_second)
        # one fetch, and the second asked nothing: one stat (the first's admission, which its fetch reuses), no
        # range asked twice, and at most a stalled stream's tail sent again (a stream that slows hands its last
        # blocks to an idle one and drops what was on the way)
        ranges = [r["range"] for r in server.requests() if r["uri"] == "/shard.tar"]
        gets = [r for r in ranges if r != "bytes=0-0"]
        assert len(ranges) - len(gets) == 1 and len(set(gets)) == len(gets), ranges
        assert len(data) <= _body_bytes(server, "/shard.tar") < 2 * len(data)
        assert (cache / "entries" / f"{key_of(url)}.data").read_bytes() == data
    finally:
        stop(server.process)


PIN = """
import sys
from redline.transfer.cache import Cache
pinned = Cache(sys.argv[1]).get(sys.argv[2])
print("pinned", flush=True)
sys.stdin.read()
"""


def test_an_entry_a_reader_holds_is_never_evicted(nginx, tmp_path: Path) -> None:
    for name in "abc":
        _file(nginx.root, name, MiB)
    root = tmp_path / "cache"
    cache = Cache(root, max_bytes=2 * MiB + MiB // 2)
    reader = subprocess.Popen(
        [sys.executable, "-c", PIN, str(root), f"{nginx.url}/a"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert reader.stdout.readline() == b"pinned\n"
        cache.get(f"{nginx.url}/b").close()
        cache.get(f"{nginx.url}/c").close()  # a is the least recently used, but held: b goes
        assert sorted(e.url[-1] for e in cache.entries()) == ["a", "c"]
        listed = json.loads(run_cli("stage", "ls", "--cache", str(root), "--json").stdout)
        assert {e["url"][-1]: e["in_use"] for e in listed["entries"]} == {"a": True, "c": False}
        evicted = run_cli("stage", "evict", f"{nginx.url}/a", "--cache", str(root))
        assert evicted.returncode == 1 and "in use by a reader, kept" in evicted.stderr
        # a cap every byte of which readers hold: the next entry is refused, in one line, naming it
        with cache.get(f"{nginx.url}/c"), pytest.raises(StageError, match=f"cannot stage {nginx.url}/b .*held by"):
            Cache(root, max_bytes=2 * MiB).get(f"{nginx.url}/b")
    finally:
        reader.stdin.close()
        reader.wait(HANG_S)
    assert run_cli("stage", "evict", f"{nginx.url}/a", "--cache", str(root)).returncode == 0
    assert [e.url[-1] for e in cache.entries()] == ["c"]


# --------------------------------------------------------------------------------------- the reader


def test_the_reader_fetches_the_next_shards_while_one_is_read_and_no_further(nginx, tmp_path: Path) -> None:
    for i in range(5):
        _file(nginx.root, f"s{i}", MiB // 4)
    urls = [f"{nginx.url}/s{i}" for i in range(5)]
    cache = Cache(tmp_path / "cache")
    reading = iter(Staged(urls, cache, ahead=2))
    first = next(reading)
    assert first.read_bytes() == (nginx.root / "s0").read_bytes()

    def ready() -> set[str]:
        return {e.url for e in cache.entries() if e.state == "ready"}

    # while s0 is read, s1 and s2 arrive without being asked for; s3 waits for its turn
    _until(lambda: {urls[1], urls[2]} <= ready(), "s1 and s2 staged ahead")
    assert not (cache.entries_dir / f"{key_of(urls[3])}.json").exists()  # not even reserved
    assert next(reading).read_bytes() == (nginx.root / "s1").read_bytes()
    _until(lambda: urls[3] in ready(), "s3 staged once s1 is read")
    assert not (cache.entries_dir / f"{key_of(urls[4])}.json").exists()
    assert [p.name for p in reading] == [f"{key_of(u)}.data" for u in urls[2:]]
    assert all(_body_bytes(nginx, f"/s{i}") == MiB // 4 for i in range(5))


def test_tar_shards_give_their_members_and_samples_in_order(nginx, tmp_path: Path) -> None:
    for shard in range(3):
        members = {}
        for k in range(4):
            members[f"train/{shard}{k:03d}.x.bin"] = bytes([shard, k]) * 100
            members[f"train/{shard}{k:03d}.cls"] = b"%d" % k
        _tar(nginx.root, f"shard-{shard}.tar", members)
    urls = [f"{nginx.url}/shard-{shard}.tar" for shard in range(3)]
    staged = Staged(urls, tmp_path / "cache", ahead=1)
    names = [m.name for m in staged.members()]
    assert names[:2] == ["train/0000.x.bin", "train/0000.cls"] and len(names) == 24
    samples = list(staged.samples())
    assert [s["__key__"] for s in samples[:2]] == ["train/0000", "train/0001"] and len(samples) == 12
    assert samples[5]["x.bin"] == bytes([1, 1]) * 100 and samples[5]["cls"] == b"1"
    assert samples[5]["__url__"] == urls[1]
    assert split_name("a/b/000017.seg.png") == ("a/b/000017", "seg.png")
    # two ranks share the shards out: every other one each
    keys = [[s["__key__"] for s in Staged(urls, tmp_path / "cache", rank=r, world=2).samples()] for r in (0, 1)]
    assert keys[0][0] == "train/0000" and keys[1][0] == "train/1000" and len(keys[0]) == 8 and len(keys[1]) == 4


def test_dataloader_workers_each_read_their_share(nginx, tmp_path: Path) -> None:
    import torch

    for shard in range(4):
        _tar(nginx.root, f"shard-{shard}.tar", {f"{shard}{k:03d}.n": b"%d" % (shard * 10 + k) for k in range(3)})
    staged = Staged([f"{nginx.url}/shard-{s}.tar" for s in range(4)], tmp_path / "cache", ahead=1)

    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            for sample in staged.samples():
                yield int(sample["n"])

    loader = torch.utils.data.DataLoader(Numbers(), batch_size=None, num_workers=2)
    seen = [int(n) for n in loader]
    assert sorted(seen) == [s * 10 + k for s in range(4) for k in range(3)]  # each once
    for s in range(4):  # and each shard fetched once, though two processes read them
        assert _body_bytes(nginx, f"/shard-{s}.tar") == (nginx.root / f"shard-{s}.tar").stat().st_size


def test_a_shard_that_cannot_be_fetched_is_named_when_the_reader_reaches_it(nginx, tmp_path: Path) -> None:
    _file(nginx.root, "s0", 1000)
    reading = iter(Staged([f"{nginx.url}/s0", f"{nginx.url}/gone"], tmp_path / "cache", ahead=1))
    assert next(reading).stat().st_size == 1000
    with pytest.raises(NotStageable, match=f"^cannot stage {nginx.url}/gone: HTTP 404"):
        next(reading)
    with pytest.raises(StageError, match=r"^cannot stage http://127\.0\.0\.1:9/s0: "):
        list(Staged(["http://127.0.0.1:9/s0"], tmp_path / "cache"))  # nothing listens on the discard port
    _file(nginx.root, "plain", 1000)
    with pytest.raises(StageError, match=f"^{nginx.url}/plain: not a tar archive"):
        list(Staged([f"{nginx.url}/plain"], tmp_path / "cache").members())


def test_bad_input_is_one_line(nginx, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no shards"):
        Staged([], tmp_path / "cache")
    with pytest.raises(BadInput, match="rank and world"):
        Staged(["x"], tmp_path / "cache", rank=2, world=2)
    (tmp_path / "file").write_text("")
    cache = ["--cache", str(tmp_path / "c")]
    cases = [
        (["add", f"{nginx.url}/missing", *cache], f"cannot stage {nginx.url}/missing: HTTP 404"),
        (["add", f"{nginx.url}/folder/", *cache], "a folder; the cache holds files"),
        (["add", "x", "--max-size", "lots", *cache], "--max-size: 'lots' is not a size"),
        (["ls", "--cache", str(tmp_path / "file")], "not a directory"),
        (["add", "", *cache], "an empty URL"),
    ]
    for argv, needle in cases:
        result = run_cli("stage", *argv)
        assert result.returncode == 2, (argv, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (argv, result.stderr)


def test_the_cli_adds_lists_and_clears(nginx, tmp_path: Path) -> None:
    for name in "ab":
        _file(nginx.root, name, 1000)
    env = {"REDLINE_HOME": str(tmp_path / "home")}
    added = run_cli("stage", "add", f"{nginx.url}/a", f"{nginx.url}/b", "--max-size", "1G", "--json", env=env)
    assert added.returncode == 0, added.stderr
    report = json.loads(added.stdout)
    assert report["cache"] == str(tmp_path / "home" / "cache") and report["max_bytes"] == 1 << 30
    assert [s["fetched"] for s in report["staged"]] == [True, True] and report["used_bytes"] == 2000
    listed = run_cli("stage", "ls", env=env)
    assert listed.returncode == 0 and f"{nginx.url}/a" in listed.stdout and "2 entries" in listed.stdout
    cleared = run_cli("stage", "clear", env=env)
    assert cleared.returncode == 0 and "removed 2 entries" in cleared.stdout
    assert json.loads(run_cli("stage", "ls", "--json", env=env).stdout)["entries"] == []


# ------------------------------------------------------------------------------ over an emulated long link


def _link_unavailable() -> str | None:
    from netem import unavailable_reason

    return unavailable_reason()


def _data_wait_after_first_shard(metrics: Path) -> tuple[float, int]:
    """Seconds the steps after the first shard's waited for their batches, and how many steps there were."""
    from staged_training import BATCH, SAMPLES_PER_SHARD

    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    later = steps[SAMPLES_PER_SHARD // BATCH :]
    return sum(s["data_s"] for s in later), len(later)


@pytest.mark.slow
def test_a_staged_loader_does_not_wait_on_the_link_after_warm_up(tmp_path: Path) -> None:
    """The same loop and shards over a 200 ms, 40 Mbit/s link: read straight, every shard costs the loop a
    connection and a request's round trips (and TCP's slow start) while it waits; read through Staged with
    4 shards ahead, only the first does. Each run is bounded by its work (8 shards of 1 MiB, 32 steps of an
    emulated 0.2 s device step); the bounds are the link's physics and a ratio, not the machine's speed."""
    reason = _link_unavailable()
    if reason:
        pytest.skip(f"emulated link: {reason}")
    import torch
    from staged_training import BATCH, FEATURES, SAMPLES_PER_SHARD

    from netem import EmulatedLink, LinkSpec

    shards = 8
    root = tmp_path / "www"
    generator = torch.Generator().manual_seed(0)
    for i in range(shards):
        samples = torch.randn(SAMPLES_PER_SHARD, FEATURES, generator=generator)
        members = {f"{i:03d}{k:03d}.f32": samples[k].numpy().tobytes() for k in range(len(samples))}
        _tar(root, f"shard-{i:03d}.tar", members)
    with EmulatedLink(LinkSpec(rtt_ms=200, loss=0, rate_mbit=40, seed=1)) as link:
        server = start_nginx(tmp_path, root, host=link.address["a"], netns=link.namespaces["a"])
        try:
            waits = {}
            for mode in ("direct", "staged"):
                metrics = tmp_path / f"{mode}.jsonl"
                argv = [sys.executable, str(HERE / "staged_training.py"), mode, server.url, str(shards), str(metrics)]
                result = link.run("b", *argv, "--cache", str(tmp_path / "cache"), timeout=600, check=False)
                assert result.returncode == 0, result.stderr[-3000:]
                waits[mode] = _data_wait_after_first_shard(metrics)
        finally:
            stop(server.process)
    (direct_s, steps), (staged_s, staged_steps) = waits["direct"], waits["staged"]
    assert steps == staged_steps == (shards - 1) * SAMPLES_PER_SHARD // BATCH
    # straight: each later shard waits at least a handshake and a request, two round trips of 200 ms
    assert direct_s >= (shards - 1) * 2 * 0.2, waits
    # staged: the next shards were on local disk already; what is left is reading them
    assert staged_s < 0.15 * direct_s, waits
