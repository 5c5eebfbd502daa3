"""redline push to moto's S3 server and OpenSSH's sftp-server on loopback: multipart uploads whose parts the
store checks, the file's SHA-256 kept for the fetch back, resume after kill -9 without sending kept parts again."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from redline import transfer
from transfer_servers import S3_ENV, SlowProxy, start_s3, start_sshd, stop

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
    server = start_s3(tmp_path)
    server.client().create_bucket(Bucket="bucket")
    yield server
    stop(server.process)


def _write(path: Path, size: int, seed: int) -> bytes:
    data = hashlib.shake_256(f"push-{seed}".encode()).digest(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def test_a_folder_goes_up_in_checked_parts_and_comes_back_verified(s3, tmp_path: Path) -> None:
    files = {
        "big.bin": _write(tmp_path / "src" / "big.bin", 12 * MiB + 1, 1),
        "sub/small.bin": _write(tmp_path / "src" / "sub" / "small.bin", 999, 2),
        "empty": _write(tmp_path / "src" / "empty", 0, 3),
    }
    summary = transfer.push(
        [str(tmp_path / "src")],
        "s3://bucket/run/",
        transfer.Options(streams=3, chunk_bytes=5 * MiB),
        endpoint_url=s3.endpoint_url,
    )
    assert sorted(f.status for f in summary.files) == ["pushed"] * 3, [f.error for f in summary.files]
    client = s3.client()
    for name, data in files.items():
        head = client.head_object(Bucket="bucket", Key=f"run/{name}")
        assert client.get_object(Bucket="bucket", Key=f"run/{name}")["Body"].read() == data
        assert head["Metadata"]["redline-sha256"] == hashlib.sha256(data).hexdigest()
    assert client.head_object(Bucket="bucket", Key="run/big.bin")["ETag"].endswith('-3"')  # 3 parts of 5 MiB
    back = transfer.fetch(["s3://bucket/run/"], tmp_path / "back", endpoint_url=s3.endpoint_url)
    assert all(f.status == "fetched" and f.verified_against == "the store's checksum" for f in back.files)
    assert not list((tmp_path / "home" / "transfer" / "push").glob("*.jsonl"))  # finished: no state left


def test_kill_9_mid_push_then_resume_sends_no_kept_part_again(s3, tmp_path: Path) -> None:
    size, part = 40 * MiB, 5 * MiB
    data = _write(tmp_path / "ckpt.pt", size, 4)
    proxy = SlowProxy(int(s3.endpoint_url.rsplit(":", 1)[1]), 8 * MiB)  # 8 MiB/s per connection
    try:
        argv = [
            "push",
            str(tmp_path / "ckpt.pt"),
            "s3://bucket/ckpt.pt",
            "--streams",
            "2",
            "--chunk-size",
            "5M",
            "--endpoint-url",
            f"http://127.0.0.1:{proxy.port}",
        ]
        first = subprocess.Popen([sys.executable, "-m", "redline", *argv], stderr=subprocess.PIPE)
        journal = _wait_for_parts(tmp_path / "home" / "transfer" / "push", 2, first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        kept = len(journal.read_text().splitlines()) - 1
        while proxy.open_pipes:  # what the killed run had in its socket buffers still reaches the server
            time.sleep(0.01)
        sent_before = proxy.upstream_bytes
        result = run_cli(*argv, "--json")
        assert result.returncode == 0, result.stderr
        resumed = json.loads(result.stdout)["files"][0]["resumed_bytes"]
        assert resumed >= kept * part
        # the second run sent the parts that were missing (and requests' headers), not the kept ones
        assert proxy.upstream_bytes - sent_before <= size - resumed + MiB
    finally:
        proxy.close()
    assert s3.client().get_object(Bucket="bucket", Key="ckpt.pt")["Body"].read() == data


def _wait_for_parts(folder: Path, count: int, process: subprocess.Popen) -> Path:
    while True:
        for journal in folder.glob("*.jsonl"):
            if len(journal.read_text().splitlines()) - 1 >= count:
                return journal
        assert process.poll() is None, process.stderr.read().decode()


def test_a_file_changed_since_the_killed_run_is_uploaded_anew(s3, tmp_path: Path) -> None:
    from redline.transfer.upload import Upload

    path = tmp_path / "f.bin"
    _write(path, 11 * MiB, 5)
    upload = Upload(path, "s3://bucket/f.bin")
    journal = upload.journal()
    journal.parent.mkdir(parents=True)
    header = {
        "version": 1,
        "size": 11 * MiB,
        "mtime_ns": 1,
        "sha256": "0" * 64,
        "part_bytes": 5 * MiB,
        "upload_id": "gone",
    }
    journal.write_text(json.dumps(header) + "\n" + json.dumps({"part": 0, "tag": '"x"'}) + "\n")
    summary = transfer.push([str(path)], "s3://bucket/f.bin", endpoint_url=s3.endpoint_url)
    result = summary.files[0]
    assert result.status == "pushed" and result.resumed_bytes == 0 and "started anew" in result.note
    assert s3.client().get_object(Bucket="bucket", Key="f.bin")["Body"].read() == path.read_bytes()


def test_sftp_push_writes_parts_over_several_connections_then_renames(tmp_path: Path) -> None:
    pytest.importorskip("paramiko")
    sshd = start_sshd(tmp_path)
    try:
        data = _write(tmp_path / "src" / "model.bin", 9 * MiB + 3, 6)
        remote = tmp_path / "remote" / "deep" / "model.bin"
        summary = transfer.push(
            [str(tmp_path / "src" / "model.bin")],
            sshd.url(remote),
            transfer.Options(streams=3, chunk_bytes=2 * MiB),
            known_hosts=sshd.known_hosts,
            key_file=sshd.key_file,
        )
    finally:
        stop(sshd.process)
    assert summary.files[0].status == "pushed", summary.files[0].error
    assert remote.read_bytes() == data
    assert sorted(p.name for p in remote.parent.iterdir()) == ["model.bin"]  # no part file left


def test_bad_push_input_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    for argv, needle in [
        ([str(tmp_path / "f"), "https://example.invalid/f"], "s3://, sftp:// or a path"),
        ([str(tmp_path / "missing"), "s3://bucket/x"], "no such file or folder"),
        ([str(tmp_path / "f")], "one source and a destination"),
    ]:
        result = run_cli("push", *argv)
        assert result.returncode == 2, (argv, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (argv, result.stderr)
