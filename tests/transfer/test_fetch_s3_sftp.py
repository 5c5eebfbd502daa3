"""redline fetch from an S3 API (moto's server mode, what s3fs's tests use) and from OpenSSH's sftp-server,
both real servers on loopback started by the tests."""

from __future__ import annotations

import base64
import hashlib
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from redline import transfer
from transfer_servers import S3_ENV, start_s3, start_sshd, stop

pytestmark = pytest.mark.system

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def s3(tmp_path: Path):
    pytest.importorskip("boto3")
    if not shutil.which("moto_server"):
        pytest.skip("needs moto's server (pip install 'moto[server]')")
    server = start_s3(tmp_path)
    yield server
    stop(server.process)


@pytest.fixture
def sshd(tmp_path: Path):
    pytest.importorskip("paramiko")
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("needs OpenSSH's server (apt-get install openssh-server)")
    server = start_sshd(tmp_path)
    yield server
    stop(server.process)


def _blob(size: int, seed: int) -> bytes:
    return hashlib.shake_256(f"s3-{seed}".encode()).digest(size)


def test_an_object_comes_in_presigned_ranges_and_is_checked_against_the_stores_sha256(s3, tmp_path: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket="data")
    body = _blob(5 * MiB + 7, 1)
    client.put_object(Bucket="data", Key="shards/000.tar", Body=body, ChecksumAlgorithm="SHA256")
    dest = tmp_path / "000.tar"
    options = transfer.Options(streams=3, chunk_bytes=MiB)
    summary = transfer.fetch(["s3://data/shards/000.tar"], dest, options, endpoint_url=s3.endpoint_url)
    result = summary.files[0]
    assert result.status == "fetched", result.error
    assert dest.read_bytes() == body
    assert result.verified_against == "the store's checksum"
    assert (
        result.sha256
        == base64.b64decode(
            client.head_object(Bucket="data", Key="shards/000.tar", ChecksumMode="ENABLED")["ChecksumSHA256"]
        ).hex()
    )


def test_a_prefix_fetches_every_object_below_it_and_a_missing_key_is_one_line(s3, tmp_path: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket="data")
    objects = {
        f"set/{name}": _blob(size, i) for i, (name, size) in enumerate([("a", 1000), ("b/c", 3 * MiB), ("d", 0)])
    }
    for key, body in objects.items():
        client.put_object(Bucket="data", Key=key, Body=body)
    client.put_object(Bucket="data", Key="other", Body=b"not below the prefix")
    summary = transfer.fetch(["s3://data/set/"], tmp_path / "out", endpoint_url=s3.endpoint_url)
    assert sorted(f.status for f in summary.files) == ["fetched"] * 3
    for key, body in objects.items():
        assert (tmp_path / "out" / key.removeprefix("set/")).read_bytes() == body
    assert not (tmp_path / "out" / "other").exists()

    missing = run_cli("fetch", "s3://data/nope", str(tmp_path / "x"), "--endpoint-url", s3.endpoint_url)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [missing.stderr.strip()]
    assert "s3://data/nope" in missing.stderr and "404" in missing.stderr


def test_sftp_fetches_a_file_in_parallel_ranges_and_a_folder(sshd, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    (remote / "sub").mkdir(parents=True)
    big, small = _blob(6 * MiB + 5, 3), _blob(1234, 4)
    (remote / "big.bin").write_bytes(big)
    (remote / "sub" / "small.bin").write_bytes(small)
    keys = {"known_hosts": sshd.known_hosts, "key_file": sshd.key_file}
    options = transfer.Options(streams=3, chunk_bytes=2 * MiB)
    one = transfer.fetch([sshd.url(remote / "big.bin")], tmp_path / "big.bin", options, **keys)
    assert one.files[0].status == "fetched", one.files[0].error
    assert (tmp_path / "big.bin").read_bytes() == big
    folder = transfer.fetch([sshd.url(remote) + "/"], tmp_path / "copy", **keys)
    assert sorted(f.status for f in folder.files) == ["fetched", "fetched"]
    assert (tmp_path / "copy" / "big.bin").read_bytes() == big
    assert (tmp_path / "copy" / "sub" / "small.bin").read_bytes() == small


def test_sftp_refuses_a_host_it_does_not_know_in_one_line(sshd, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    result = run_cli(
        "fetch",
        sshd.url(tmp_path / "f"),
        str(tmp_path / "g"),
        "--ssh-key",
        str(sshd.key_file),
        env={"HOME": str(tmp_path / "nohome")},
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown host key" in lines[0] and "ssh-keyscan" in lines[0], result.stderr
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_an_object_replaced_mid_fetch_is_never_spliced(s3, tmp_path: Path, versioned: bool) -> None:
    """S3 ignores If-Range: the object is put anew (same size) once the first blocks have arrived. Its GETs are
    pinned: by If-Match (the store answers 412, the file fails in one line, nothing lands), or, in a bucket
    with versions, by the version id (the fetch finishes with the version it began on)."""
    client = s3.client()
    client.create_bucket(Bucket="data")
    if versioned:
        client.put_bucket_versioning(Bucket="data", VersioningConfiguration={"Status": "Enabled"})
    old, new = _blob(4 * MiB, 10), _blob(4 * MiB, 11)
    client.put_object(Bucket="data", Key="shard.tar", Body=old)

    class ReplaceAfterFirstBlocks(transfer.Progress):
        moved = 0

        def advance(self, size: int) -> None:
            self.moved += size
            if self.moved >= MiB and self.moved - size < MiB:  # once, after the first request's bytes
                client.put_object(Bucket="data", Key="shard.tar", Body=new)

    dest = tmp_path / "shard.tar"
    options = transfer.Options(streams=1, chunk_bytes=MiB)
    summary = transfer.fetch(
        ["s3://data/shard.tar"], dest, options, endpoint_url=s3.endpoint_url, progress=ReplaceAfterFirstBlocks()
    )
    result = summary.files[0]
    if versioned:
        assert result.status == "fetched", result.error
        assert dest.read_bytes() == old
    else:
        assert result.status == "failed" and not dest.exists(), result
        assert "s3://data/shard.tar" in result.error and "replaced during the fetch" in result.error, result.error
        assert result.retries == 0


def test_sftp_and_local_folders_treat_symlinks_alike(sshd, tmp_path: Path) -> None:
    """A folder holding a symlinked file, a symlinked folder and a link back up to itself: skipped and named by
    both (rclone's default); followed by both with copy_links (-L/--copy-links), the loop walked once."""
    folder = tmp_path / "folder"
    (folder / "real").mkdir(parents=True)
    (folder / "real" / "a.bin").write_bytes(_blob(1000, 20))
    (tmp_path / "outside.bin").write_bytes(_blob(2000, 21))
    (folder / "linked.bin").symlink_to(tmp_path / "outside.bin")
    (folder / "linked-dir").symlink_to(folder / "real")
    (folder / "real" / "up").symlink_to(folder)
    keys = {"known_hosts": sshd.known_hosts, "key_file": sshd.key_file}
    for follow, expected in [
        (False, ["real/a.bin"]),
        (True, ["linked-dir/a.bin", "linked.bin", "real/a.bin"]),
    ]:
        options = transfer.Options(copy_links=True) if follow else transfer.Options()  # the default: skip them
        landed, skipped = {}, {}
        for name, url in [("sftp", sshd.url(folder) + "/"), ("local", f"{folder}/")]:
            out = tmp_path / f"{name}-{follow}"
            summary = transfer.fetch([url], out, options, **keys)
            assert all(f.status == "fetched" for f in summary.files), summary.files
            landed[name] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
            skipped[name] = sorted(s.removeprefix(url.rstrip("/") + "/") for s in getattr(summary, "skipped", []))
        assert landed == {"sftp": expected, "local": expected}
        said = (
            ["linked-dir/up (a link to a folder above it)", "real/up (a link to a folder above it)"]
            if follow
            else ["linked-dir (a symlink)", "linked.bin (a symlink)", "real/up (a symlink)"]
        )
        assert skipped == {"sftp": said, "local": said}
    assert (tmp_path / "sftp-True" / "linked.bin").read_bytes() == (tmp_path / "outside.bin").read_bytes()
