"""redline fetch against servers that misbehave as real ones do (a small HTTP server on loopback): one that
ignores If-Range while the file is replaced under it, one without byte ranges (python -m http.server), one
that answers chunked without a length, malformed lengths, redirects to file:// and in a loop, IPv6 loopback;
and URLs no source can be made of. Each as a user meets it: the CLI, off a terminal, 80 columns."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest

from conftest import run_cli
from redline import transfer
from redline.transfer import journal
from transfer_servers import HostileServer, Misbehaviour

KiB, MiB = 1 << 10, 1 << 20
NARROW = {"COLUMNS": "80"}


@pytest.fixture(autouse=True)
def _no_saved_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path / "home"))


def _bytes(size: int, seed: int) -> bytes:
    return hashlib.shake_256(f"hostile-{seed}".encode()).digest(size)


def _serve(data: bytes, how: Misbehaviour, replacement: bytes | None = None, host: str = "127.0.0.1"):
    return HostileServer(data, how, replacement, host)


def _one_line(result, code: int) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    return lines[0]


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "validator",
    [
        Misbehaviour(replace_after=4),  # a new ETag and Last-Modified
        Misbehaviour(replace_after=4, etag=None),  # Last-Modified alone says so
    ],
    ids=["etag", "last-modified"],
)
def test_a_file_replaced_mid_fetch_by_a_server_ignoring_if_range_is_never_spliced(
    tmp_path: Path, validator: Misbehaviour
) -> None:
    """The server answers every range with 206 whatever If-Range says; after the stat and three ranges the file
    is another of the same size. Each answer's validators are checked: the file fails in one line, nothing of
    either version lands."""
    old, new = _bytes(MiB, 1), _bytes(MiB, 2)
    server = _serve(old, validator, replacement=new)
    try:
        dest = tmp_path / "out" / "file.bin"
        result = run_cli("fetch", server.url, str(dest), "--streams", "1", "--chunk-size", "64K", env=NARROW)
    finally:
        server.close()
    line = _one_line(result, 1)
    assert server.url in line and "changed on the server during the fetch" in line, line
    assert not dest.exists()
    # what was verified of the old file stays for the journal; a run against the new file starts anew
    assert _left(dest.parent) == ["file.bin.redline-journal", "file.bin.redline-part"]


@pytest.mark.parametrize("streams", ["1", "4"])
def test_a_server_without_byte_ranges_is_read_whole_over_one_stream(tmp_path: Path, streams: str) -> None:
    """As python -m http.server: every GET is a 200 of the whole file. aria2c, curl and rclone fetch it; so
    does redline, over one stream, whatever --streams says."""
    data = _bytes(3 * MiB + 5, 3)
    server = _serve(data, Misbehaviour(ranges=False, etag=None))
    try:
        dest = tmp_path / "file.bin"
        result = run_cli("fetch", server.url, str(dest), "--streams", streams, "--chunk-size", "1M", "--json")
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    assert dest.read_bytes() == data and not journal.part_path(dest).exists()
    assert server.gets == 2  # the stat, then the whole file once


def test_without_ranges_a_resume_starts_from_the_beginning_and_says_so_once(tmp_path: Path) -> None:
    data = _bytes(2 * MiB, 4)
    dest = tmp_path / "file.bin"
    server = _serve(data, Misbehaviour(ranges=False))
    try:
        # an earlier run's state: its first block recorded, with its true hash
        remote = transfer.source.Remote(server.url, len(data), '"v1"', 1704067200.0, ranged=False)
        state = journal.Journal.open(journal.landing(dest), remote, 256 * KiB)
        with open(journal.part_path(dest), "r+b") as part:
            part.write(data[: 256 * KiB])
        state.record(0, hashlib.sha256(data[: 256 * KiB]).hexdigest())
        result = run_cli("fetch", server.url, str(dest), "--chunk-size", "256K", env=NARROW)
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "no byte ranges" in line]
    assert len(notes) == 1 and "256.0 KiB" in notes[0], result.stderr
    assert dest.read_bytes() == data


def test_a_dropped_answer_without_ranges_is_read_again_from_the_start(tmp_path: Path) -> None:
    data = _bytes(2 * MiB, 5)
    server = _serve(data, Misbehaviour(ranges=False, cut_first=MiB + 1000))
    try:
        options = transfer.Options(streams=2, chunk_bytes=256 * KiB, retries=3)
        summary = transfer.fetch([server.url], tmp_path / "file.bin", options)
    finally:
        server.close()
    result = summary.files[0]
    assert result.status == "fetched", result.error
    assert (tmp_path / "file.bin").read_bytes() == data and result.retries == 1


def test_a_chunked_answer_without_a_length_is_read_to_its_end(tmp_path: Path) -> None:
    data = _bytes(MiB + 77, 6)
    server = _serve(data, Misbehaviour(ranges=False, length="chunked"))
    try:
        result = run_cli("fetch", server.url, str(tmp_path / "file.bin"), "--json")
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "file.bin").read_bytes() == data
    summary = json.loads(result.stdout)["files"][0]
    assert summary["size"] == len(data) and summary["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("length", ["abc", str(2**70), "-5"])
@pytest.mark.parametrize("ranges", [False, True], ids=["whole", "ranged"])
def test_a_content_length_that_is_no_size_is_one_line_naming_the_url(tmp_path: Path, length: str, ranges: bool) -> None:
    _malformed_answer(Misbehaviour(ranges=ranges, length=length), tmp_path)


def _malformed_answer(how: Misbehaviour, tmp_path: Path) -> str:
    """The one line a fetch from a server answering as ``how`` says fails with (exit 1, naming the URL, nothing
    left behind)."""
    server = _serve(_bytes(1000, 7), how)
    try:
        dest = tmp_path / "file.bin"
        result = run_cli("fetch", server.url, str(dest), "--retries", "1", env=NARROW)
    finally:
        server.close()
    line = _one_line(result, 1)
    assert server.url in line, line
    assert not dest.exists() and not journal.part_path(dest).exists()
    return line


@pytest.mark.parametrize(
    "content_range",
    [f"bytes 0-0/{'9' * 5000}", f"bytes {'1' * 5000}-0/1000", "bytes 0-0/99999999999999999999"],
    ids=["total-5000-digits", "first-5000-digits", "total-20-digits"],
)
def test_a_content_range_with_a_number_past_any_size_is_one_line_naming_the_url(
    tmp_path: Path, content_range: str
) -> None:
    """Python will not even make an int of a 5000-digit number (it raised "Exceeds the limit")."""
    line = _malformed_answer(Misbehaviour(content_range=content_range), tmp_path)
    assert "Content-Range" in line, line


def test_ipv6_loopback_is_a_host_like_any_other(tmp_path: Path) -> None:
    try:
        server = _serve(_bytes(MiB, 8), Misbehaviour(), host="::1")
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        result = run_cli("fetch", server.url, str(tmp_path / "file.bin"), "--streams", "2", "--chunk-size", "256K")
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "file.bin").read_bytes() == server.data


@pytest.mark.parametrize(
    ("location", "needle"),
    [("file:///etc/passwd", "only http(s) redirects are followed"), (None, "more than 10 redirects")],
    ids=["file", "loop"],
)
def test_redirects_go_to_http_only_and_a_bounded_number_of_times(tmp_path: Path, location, needle: str) -> None:
    server = _serve(b"", Misbehaviour())
    server.how.redirect = location or server.url  # to itself: a loop
    try:
        dest = tmp_path / "file.bin"
        result = run_cli("fetch", server.url, str(dest), env=NARROW)
        again = run_cli("fetch", server.url, str(dest), "--json")
    finally:
        server.close()
    line = _one_line(result, 1)
    assert needle in line and server.url in line, line
    assert json.loads(again.stdout)["files"][0]["retries"] == 0  # refused at once, never retried
    assert not dest.exists() and server.gets <= 2 * 11  # two runs, each at most the first GET and 10 more


def test_a_redirect_with_an_endless_body_is_not_read(tmp_path: Path) -> None:
    """Every GET of one server is a 302 to a good one, with a body of 1 TiB that never ends: the fetch hangs up
    on it and follows the Location (it read the body to its end, and stalled there)."""
    good = _serve(_bytes(MiB, 9), Misbehaviour())
    hostile = _serve(b"", Misbehaviour(redirect=good.url, endless_redirect=True))
    try:
        dest = tmp_path / "file.bin"
        result = run_cli("fetch", hostile.url, str(dest), "--streams", "2", "--chunk-size", "256K", timeout=120)
    finally:
        hostile.close()
        good.close()
    assert result.returncode == 0, result.stderr
    assert dest.read_bytes() == good.data
    assert hostile.endless_bytes < hostile.gets * 16 * MiB  # what socket buffers hold, not the body


def test_a_range_answered_with_an_endless_body_is_not_read_to_its_end(tmp_path: Path) -> None:
    """The stat's one-byte range (and every range after) answered 206 with a body of 1 TiB that never ends: the
    stat hangs up on it (it read it to its end, and stalled there), the read refuses it, one line."""
    hostile = _serve(_bytes(MiB, 10), Misbehaviour(endless_ranges=True))
    try:
        result = run_cli("fetch", hostile.url, str(tmp_path / "file.bin"), "--retries", "0", timeout=120, env=NARROW)
    finally:
        hostile.close()
    line = _one_line(result, 1)
    assert hostile.url in line and "Content-Length" in line, line
    assert hostile.endless_bytes < hostile.gets * 16 * MiB  # what socket buffers hold, not the body


def test_urls_no_source_can_be_made_of_are_bad_input(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    for url, code, needle in [
        ("http://127.0.0.1:99999/x.bin", 2, "port"),
        ("http://127.0.0.1:0/x.bin", 2, "port"),
        ("sftp://me@127.0.0.1:70000/x.bin", 2, "port"),
        ("gopher://127.0.0.1/x.bin", 2, "gopher://"),
        ("http:///x.bin", 2, "names no host"),
        (f"ftp://127.0.0.1:{closed}/x.bin", 1, "refused"),  # fsspec's FTP: a server that is not there
    ]:
        result = run_cli("fetch", url, str(tmp_path / "x.bin"), "--retries", "0", env=NARROW)
        line = _one_line(result, code)
        assert needle in line and url.split("/x.bin")[0] in line, (url, line)
    assert not (tmp_path / "x.bin").exists()
