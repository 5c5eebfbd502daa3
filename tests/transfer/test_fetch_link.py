"""redline fetch inside an emulated long link (tools/netem: two network namespaces, 100 ms RTT, loss, a rate
cap), the servers on the far side: from nginx it sizes itself to the link it measures, and a kill -9
mid-transfer resumes; OpenSSH's sftp-server and moto's S3 server carry a push and a fetch across it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netem import EmulatedLink, LinkSpec, unavailable_reason
from netem.link import A_ADDR
from redline.transfer import journal
from redline.transfer.fetcher import BLOCK_BYTES as BLOCK
from transfer_servers import S3_ENV, start_nginx, start_s3, start_sshd, stop

MiB = 1 << 20
REASON = unavailable_reason() or (None if shutil.which("nginx") else "needs nginx")
pytestmark = [pytest.mark.system, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture
def far_nginx(tmp_path: Path):
    (tmp_path / "www").mkdir()
    with EmulatedLink(LinkSpec(rtt_ms=100, loss=0.001, rate_mbit=50)) as link:
        server = start_nginx(tmp_path, tmp_path / "www", host=A_ADDR, netns=link.namespaces["a"], port=8090)
        try:
            yield link, server
        finally:
            stop(server.process)


def _redline(link: EmulatedLink, tmp_path: Path, verb: str, *argv: str) -> subprocess.Popen:
    """``redline VERB ARGV... --json`` on the near side of the link."""
    env = dict(os.environ, REDLINE_HOME=str(tmp_path / "home"), **S3_ENV)
    command = [sys.executable, "-m", "redline", verb, *argv, "--json"]
    return subprocess.Popen(link.argv("b", *command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _done(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err.decode()
    return json.loads(out)


def test_over_a_long_link_fetch_sizes_itself_and_resumes_after_kill_9(far_nginx, tmp_path: Path) -> None:
    link, server = far_nginx
    data = hashlib.shake_256(b"far").digest(12 * MiB)
    (server.root / "far.bin").write_bytes(data)
    url = f"http://{A_ADDR}:8090/far.bin"

    # left to itself: the handshake says 100 ms, a long link, so many streams of at least 8 MiB
    summary = _done(_redline(link, tmp_path, "fetch", url, str(tmp_path / "plain.bin")))
    assert summary["link"]["rtt_s"] >= 0.09 and summary["streams"] == 16 and summary["chunk_bytes"] == 8 * MiB
    assert (tmp_path / "plain.bin").read_bytes() == data

    # nginx logs a request when it has handed its last byte to the kernel, which can be after the client has it:
    # wait for the first fetch's whole file in the log, or its late lines count against the resumed fetch
    deadline = time.monotonic() + 60
    while (baseline := server.sent_bytes("/far.bin")) < len(data) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert baseline >= len(data)
    dest = tmp_path / "resumed.bin"
    argv = (url, str(dest), "--streams", "3", "--chunk-size", "1M")
    first = _redline(link, tmp_path, "fetch", *argv)
    path = journal.journal_path(dest)
    while not path.exists() or len(path.read_text().splitlines()) < 1 + 3 * MiB // BLOCK:  # the header, 3 MiB
        assert first.poll() is None, first.stderr.read().decode()
    first.send_signal(signal.SIGKILL)  # ip netns exec execs the command: this is redline itself
    first.wait()
    resumed = _done(_redline(link, tmp_path, "fetch", *argv))
    assert dest.read_bytes() == data and resumed["files"][0]["resumed_bytes"] >= 3 * MiB
    # both runs of the resumed fetch together sent the file once, plus at most the 3 chunks in flight at the kill
    assert 0 <= server.sent_bytes("/far.bin") - baseline - 12 * MiB <= 3 * MiB + 2


@pytest.mark.slow  # two servers, four transfers across 100 ms: about 20 s idle, more under load
def test_sftp_and_s3_carry_a_push_and_a_fetch_across_the_long_link(tmp_path: Path) -> None:
    pytest.importorskip("paramiko")
    pytest.importorskip("boto3")
    if not (Path("/usr/sbin/sshd").exists() and shutil.which("moto_server")):
        pytest.skip("needs OpenSSH's server and moto's S3 server")
    data = hashlib.shake_256(b"far-sftp-s3").digest(6 * MiB + 5)
    (tmp_path / "local.bin").write_bytes(data)
    with EmulatedLink(LinkSpec(rtt_ms=100, loss=0.001, rate_mbit=50)) as link:
        sshd = start_sshd(tmp_path, host=A_ADDR, netns=link.namespaces["a"], port=2222)
        s3 = start_s3(tmp_path, host=A_ADDR, netns=link.namespaces["a"], port=5000)
        try:
            ssh = ("--known-hosts", str(sshd.known_hosts), "--ssh-key", str(sshd.key_file))
            far = tmp_path / "far"
            far.mkdir()
            pushed = _done(
                _redline(link, tmp_path, "push", str(tmp_path / "local.bin"), sshd.url(far / "up.bin"), *ssh)
            )
            assert pushed["files"][0]["status"] == "pushed" and (far / "up.bin").read_bytes() == data
            fetched = _done(
                _redline(link, tmp_path, "fetch", sshd.url(far / "up.bin"), str(tmp_path / "sftp.bin"), *ssh)
            )
            assert fetched["link"]["rtt_s"] >= 0.09 and (tmp_path / "sftp.bin").read_bytes() == data

            s3_args = ("--endpoint-url", s3.endpoint_url)
            # the bucket is made across the link too: the test's own namespace cannot reach the far side
            make = [sys.executable, "-c", f"import boto3; boto3.client('s3', endpoint_url='{s3.endpoint_url}')"
                    ".create_bucket(Bucket='far')"]  # fmt: skip
            subprocess.run(link.argv("b", *make), check=True, env=dict(os.environ, **S3_ENV), timeout=120)
            pushed = _done(_redline(link, tmp_path, "push", str(tmp_path / "local.bin"), "s3://far/up.bin", *s3_args))
            assert pushed["files"][0]["status"] == "pushed"
            fetched = _done(_redline(link, tmp_path, "fetch", "s3://far/up.bin", str(tmp_path / "s3.bin"), *s3_args))
            assert (tmp_path / "s3.bin").read_bytes() == data
            assert fetched["files"][0]["verified_against"] == "the store's checksum"  # what push left in the metadata
        finally:
            stop(s3.process)
            stop(sshd.process)
