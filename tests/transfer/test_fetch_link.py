"""redline fetch inside an emulated long link (tools/netem: two network namespaces, 100 ms RTT, loss, a rate
cap), nginx on the far side: it sizes itself to the link it measures, and a kill -9 mid-transfer resumes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netem import EmulatedLink, LinkSpec, unavailable_reason
from netem.link import A_ADDR
from redline.transfer import journal
from transfer_servers import start_nginx, stop

MiB = 1 << 20
REASON = unavailable_reason() or (None if shutil.which("nginx") else "needs nginx")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def far_nginx(tmp_path: Path):
    (tmp_path / "www").mkdir()
    with EmulatedLink(LinkSpec(rtt_ms=100, loss=0.001, rate_mbit=50)) as link:
        server = start_nginx(tmp_path, tmp_path / "www", host=A_ADDR, netns=link.namespaces["a"], port=8090)
        try:
            yield link, server
        finally:
            stop(server.process)


def _fetch(link: EmulatedLink, tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = dict(os.environ, REDLINE_HOME=str(tmp_path / "home"))
    command = [sys.executable, "-m", "redline", "fetch", *argv, "--json"]
    return subprocess.Popen(link.argv("b", *command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_over_a_long_link_fetch_sizes_itself_and_resumes_after_kill_9(far_nginx, tmp_path: Path) -> None:
    link, server = far_nginx
    data = hashlib.shake_256(b"far").digest(12 * MiB)
    (server.root / "far.bin").write_bytes(data)
    url = f"http://{A_ADDR}:8090/far.bin"

    # left to itself: the handshake says 100 ms, a long link, so many streams of at least 8 MiB
    plain = _fetch(link, tmp_path, url, str(tmp_path / "plain.bin"))
    out, err = plain.communicate(timeout=600)
    assert plain.returncode == 0, err.decode()
    summary = json.loads(out)
    assert summary["link"]["rtt_s"] >= 0.09 and summary["streams"] == 16 and summary["chunk_bytes"] == 8 * MiB
    assert (tmp_path / "plain.bin").read_bytes() == data

    baseline = server.sent_bytes("/far.bin")
    dest = tmp_path / "resumed.bin"
    argv = (url, str(dest), "--streams", "3", "--chunk-size", "1M")
    first = _fetch(link, tmp_path, *argv)
    path = journal.journal_path(dest)
    while not path.exists() or len(path.read_text().splitlines()) < 4:  # the header and three chunks
        assert first.poll() is None, first.stderr.read().decode()
    first.send_signal(signal.SIGKILL)  # ip netns exec execs the command: this is redline itself
    first.wait()
    second = _fetch(link, tmp_path, *argv)
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, err.decode()
    assert dest.read_bytes() == data and json.loads(out)["files"][0]["resumed_bytes"] >= 3 * MiB
    # both runs of the resumed fetch together sent the file once, plus at most the 3 chunks in flight at the kill
    assert 0 <= server.sent_bytes("/far.bin") - baseline - 12 * MiB <= 3 * MiB + 2
