"""The registry of URL schemes (``transfer.schemes``): each scheme registered with the traits expected, a URL
looked up to its record (an unknown one in the one line fetch has always given), and each record's openers
making the source, listing and destination of its kind from one session, in process and without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline import transfer
from redline.capability import is_available
from redline.errors import BadInput
from redline.transfer import schemes
from redline.transfer.schemes import FSSPEC, HTTP, LOCAL, S3, SCHEMES, SFTP, Ranges
from redline.transfer.session import Session, check_url
from redline.transfer.source import Credentials, Sockets

FETCH_READS = "fetch reads http(s)://, s3://, sftp://, paths and the URLs fsspec knows"


@pytest.mark.parametrize(
    ("scheme", "names", "display", "ranges", "pushed_to", "host", "local"),
    [
        (HTTP, ("http", "https"), "http(s)://", Ranges.IF_SERVER_HONOURS, False, True, False),
        (S3, ("s3",), "s3://", Ranges.ALWAYS, True, False, False),
        (SFTP, ("sftp",), "sftp://", Ranges.ALWAYS, True, True, False),
        (LOCAL, ("file",), "paths", Ranges.ALWAYS, False, False, True),
        (FSSPEC, (), "the URLs fsspec knows", Ranges.ALWAYS, False, False, False),
    ],
    ids=["http", "s3", "sftp", "local", "fsspec"],
)
def test_each_scheme_is_registered_with_its_traits(
    scheme: schemes.Scheme,
    names: tuple[str, ...],
    display: str,
    ranges: Ranges,
    pushed_to: bool,
    host: bool,
    local: bool,
) -> None:
    assert scheme in SCHEMES
    assert (scheme.names, scheme.display, scheme.ranges) == (names, display, ranges)
    assert (scheme.destination is not None, scheme.host, scheme.local) == (pushed_to, host, local)


def test_fsspec_comes_last_so_that_it_never_takes_a_scheme_of_redline_s_own() -> None:
    assert SCHEMES[-1] is FSSPEC
    own = [name for scheme in SCHEMES[:-1] for name in scheme.names]
    assert len(own) == len(set(own)), "a scheme name registered twice"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://host/a.bin", HTTP),
        ("https://host/a.bin", HTTP),
        ("s3://bucket/key", S3),
        ("sftp://user@host/data/", SFTP),
        ("/data/a.bin", LOCAL),
        ("relative/a.bin", LOCAL),
        ("file:///data/a.bin", LOCAL),
        ("C:\\data\\a.bin", LOCAL),  # a drive letter, not a scheme
    ],
)
def test_a_url_is_looked_up_to_the_record_of_its_scheme(url: str, expected: schemes.Scheme) -> None:
    assert schemes.lookup(url) is expected
    assert schemes.is_local(url) == expected.local


@pytest.mark.skipif(not is_available("fsspec"), reason="needs fsspec")
def test_a_scheme_only_fsspec_knows_goes_to_fsspec() -> None:
    assert schemes.lookup("memory://bucket/a.bin") is FSSPEC


def test_an_unknown_scheme_is_the_one_line_fetch_has_always_given() -> None:
    with pytest.raises(BadInput) as caught:
        schemes.lookup("warp://host/a.bin")
    assert str(caught.value) == f"warp://host/a.bin: {FETCH_READS}, not warp://"
    assert schemes.find("warp://host/a.bin") is None and not schemes.is_local("warp://host/a.bin")
    with pytest.raises(BadInput) as caught:
        check_url("warp://x")
    assert str(caught.value) == f"warp://x: {FETCH_READS}, not warp://"


@pytest.mark.parametrize("dest", ["warp://host/x", "http://host/x", "memory://bucket/x"])
def test_push_to_a_scheme_without_a_destination_names_those_with_one(dest: str) -> None:
    assert schemes.push_targets() == "s3://, sftp:// or a path"
    with pytest.raises(BadInput) as caught:
        transfer.push([__file__], dest)
    assert str(caught.value) == f"{dest}: redline push sends to s3://, sftp:// or a path"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http:///a.bin", "http:///a.bin: names no host"),
        ("sftp://host:0/a", "sftp://host:0/a: the port is not a number from 1 to 65535"),
        ("https://host:99999/a", "https://host:99999/a: the port is not a number from 1 to 65535"),
    ],
)
def test_a_scheme_whose_urls_name_a_host_has_it_checked(url: str, message: str) -> None:
    with pytest.raises(BadInput) as caught:
        check_url(url)
    assert str(caught.value) == message


# ------------------------------------------------------------------------------------------------ openers


class Counted:
    """Connections that count their closes."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_session_makes_each_shared_connection_once_and_closes_it_once() -> None:
    session = Session(Sockets(), 4)
    made: list[Counted] = []

    def make() -> Counted:
        made.append(Counted())
        return made[-1]

    first, again = session.shared("x", make), session.shared("x", make)
    assert first is again and len(made) == 1
    session.close()
    session.close()
    assert first.closed == 1


def test_local_records_open_a_file_read_in_ranges_and_list_a_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"b")
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "link").symlink_to("a.bin")
    session = Session(Sockets(), 4)
    remote = LOCAL.source(session, str(tmp_path / "a.bin")).stat()
    assert remote.size == 3 and remote.ranged is (LOCAL.ranges is Ranges.ALWAYS)
    listed = LOCAL.listing(session, f"file://{tmp_path}/")
    assert [name for _, name in listed] == ["a.bin", "sub/b.bin"]
    assert session.skipped == [f"{tmp_path}/link (a symlink)"]


def test_http_opens_a_source_and_gives_no_listing() -> None:
    session = Session(Sockets(), 4)
    source = HTTP.source(session, "http://host/data/a.bin")
    assert (type(source).__name__, source.endpoint) == ("HttpSource", "http://host:80")
    assert HTTP.source(session, "https://host/b.bin").pools is source.pools  # one set of pools per transfer
    with pytest.raises(BadInput, match="an HTTP server gives no listing to fetch; name the files"):
        HTTP.listing(session, "http://host/data/")
    session.close()


@pytest.mark.skipif(not is_available("boto3"), reason="needs boto3")
def test_s3_opens_sources_and_a_destination_on_one_client_at_the_credentials_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "x"}.items():
        monkeypatch.setenv(name, value)  # presigning is local: no store is asked
    session = Session(Sockets(), 4, Credentials(endpoint_url="http://127.0.0.1:9000"))
    source = S3.source(session, "s3://bucket/data/a.bin")
    assert source.s3.meta.endpoint_url == "http://127.0.0.1:9000"
    assert source.request_url().startswith("http://127.0.0.1:9000/bucket/data/a.bin?")
    destination = S3.destination(session, "s3://bucket/data/")
    assert destination.s3 is source.s3 and destination.pools is source.pools
    assert destination.endpoint == "http://127.0.0.1:9000"
    session.close()


@pytest.mark.skipif(not is_available("paramiko"), reason="needs paramiko")
def test_sftp_opens_a_source_and_a_destination_with_the_credentials_keys(tmp_path: Path) -> None:
    credentials = Credentials(known_hosts=tmp_path / "known_hosts", key_file=tmp_path / "id_ed25519")
    session = Session(Sockets(), 4, credentials)
    source = SFTP.source(session, "sftp://someone@host:2222/data/a.bin")  # nothing connects until a read
    assert source.endpoint == "sftp://someone@host:2222"
    assert (source.pool.known_hosts, source.pool.key_file) == (credentials.known_hosts, credentials.key_file)
    destination = SFTP.destination(session, "sftp://someone@host:2222/data/")
    assert destination.pool is source.pool and destination.endpoint == source.endpoint
    session.close()


@pytest.mark.skipif(not is_available("fsspec"), reason="needs fsspec")
def test_fsspec_opens_and_lists_what_its_filesystem_holds() -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/redline-schemes/a.bin", b"abc")
    memory.pipe("/redline-schemes/sub/b.bin", b"b")
    try:
        session = Session(Sockets(), 4)
        listed = FSSPEC.listing(session, "memory://redline-schemes/")
        assert [name for _, name in listed] == ["a.bin", "sub/b.bin"]
        remote = FSSPEC.source(session, listed[0][0]).stat()
        assert remote.size == 3 and remote.ranged is (FSSPEC.ranges is Ranges.ALWAYS)
    finally:
        memory.rm("/redline-schemes", recursive=True)
