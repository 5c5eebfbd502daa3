"""HTTP(S) sources: ranged GETs through one urllib3 pool per endpoint.

Every answer is checked against the validators the fetch started from (its strong ETag, its Last-Modified,
its total size from Content-Range or Content-Length) before a byte of it is kept: a server that ignores
``If-Range`` (S3 does, and so do some HTTP servers) and answers a range of a file replaced meanwhile would
otherwise splice two versions into one file. A range request still carries ``If-Range``, so a server that
honours it sends the new file whole instead, which fails the same check.

A server without byte ranges (``python -m http.server``, many artifact servers) sends the whole file to each
request: the file comes over one stream, and a retry reads it from the start again, skipping what is on disk.
A server that gives no length (a chunked answer) is read to its end. ``Accept-Encoding: identity`` keeps byte
offsets those of the file itself. Redirects are followed by hand, to http(s) only, at most ``MAX_REDIRECTS``
times, their bodies never read (one may not end); any answer that cannot be a file's is one line naming the URL.
"""

from __future__ import annotations

import email.utils
import re
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

import urllib3

from redline.errors import BadInput, one_line
from redline.transfer.source import PIECE_BYTES, Changed, Remote, Sink, Sockets, Source, TransferError, read_end

if TYPE_CHECKING:
    from redline.transfer.session import Session

# at most 19 digits a number (2^63 has 19): a longer one is no file's offset or size, and Python refuses to
# make an int of one past 4300 digits (a ValueError that surfaced as "internal error")
_CONTENT_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)")
_DIGITS = re.compile(r"\d{1,19}")
# a retry will not help these; 408, 425, 429 and 5xx are worth one
_PERMANENT = {400, 401, 403, 404, 405, 410, 411, 414, 451}
_REDIRECTS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 10  # curl's and wget's defaults are 50 and 20; a presigned store URL takes one or two
MAX_SIZE_BYTES = 1 << 60  # 1 EiB: a length past this is no file's, whatever the header says


class Pools:
    """One urllib3 pool manager per transfer: connections kept alive per endpoint, at most ``per_endpoint``
    of them, the sockets made as ``sockets`` says."""

    def __init__(self, sockets: Sockets, per_endpoint: int) -> None:
        self.sockets = sockets
        self._manager = urllib3.PoolManager(
            num_pools=64,
            maxsize=per_endpoint,
            block=True,  # a request waits for a free connection rather than opening one past the cap
            retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=0),
            timeout=urllib3.Timeout(connect=sockets.connect_timeout_s, read=sockets.read_timeout_s),
            socket_options=sockets.options(),
        )

    def request(
        self, method: str, url: str, headers: dict[str, str], body: bytes | None = None, display: str = ""
    ) -> urllib3.BaseHTTPResponse:
        """The answer to ``method url``, redirects followed here (urllib3 would follow one to any scheme it
        knows, and a redirect to file:// came back as an error a retry seemed to cure)."""
        display = display or url
        for _ in range(MAX_REDIRECTS + 1):
            try:
                response = self._manager.request(
                    method, url, headers=headers, body=body, preload_content=False, redirect=False
                )
            except (urllib3.exceptions.LocationValueError, urllib3.exceptions.InvalidHeader) as exc:
                raise TransferError(f"{display}: {one_line(exc, typed=False)}") from None
            location = response.headers.get("Location") if response.status in _REDIRECTS else None
            if location is None:
                return response
            _done_with(response, drain=False)  # closed, not read: a redirect's body may never end
            url = _redirect_target(url, location, display)
            if response.status == 303:
                method, body = "GET", None
        raise TransferError(f"{display}: more than {MAX_REDIRECTS} redirects")

    def connect(self, url: str) -> None:
        """Open one connection to ``url``'s endpoint ahead of its first request, where the pool has room
        (urllib3 connects on first use). urllib3 has no public call for it: this takes a connection from the
        pool, connects it and puts it back, as a request would."""
        pool = self._manager.connection_from_url(url)
        conn = pool._get_conn()
        try:
            if not conn.is_connected:
                conn.connect()
        except (OSError, urllib3.exceptions.HTTPError):  # refused, unreachable, timed out (NewConnectionError...)
            conn.close()  # the request that follows meets the same failure and reports it
        finally:
            pool._put_conn(conn)

    def close(self) -> None:
        self._manager.clear()


def pools(session: Session) -> Pools:
    """The transfer's HTTP connection pools (an S3 source's bytes go through them too)."""
    return session.shared("http", lambda: Pools(session.sockets, session.per_endpoint))


def open_source(session: Session, url: str) -> HttpSource:
    return HttpSource(url, pools(session))


def no_listing(session: Session, url: str) -> list[tuple[str, str]]:
    raise BadInput(f"{url}: an HTTP server gives no listing to fetch; name the files")


def _redirect_target(url: str, location: str, display: str) -> str:
    target = urljoin(url, location.strip())
    scheme = urlsplit(target).scheme.lower()
    if scheme not in ("http", "https"):
        raise TransferError(f"{display}: redirected to {scheme}:// ({target}); only http(s) redirects are followed")
    return target


def host_port(url: str) -> tuple[str, int]:
    """``url``'s host (an IPv6 literal in brackets) and port; TransferError for a port out of range."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise TransferError(f"{url}: the port is not a number from 1 to 65535") from None
    host = parts.hostname or ""
    return (f"[{host}]" if ":" in host else host), port or (443 if parts.scheme == "https" else 80)


def endpoint_of(url: str) -> str:
    host, port = host_port(url)
    return f"{urlsplit(url).scheme}://{host}:{port}"


def _http_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def check_status(response: urllib3.BaseHTTPResponse, url: str) -> None:
    """A status a retry cannot fix is a TransferError naming it; others (5xx, 429) raise for a retry. 412:
    a store that honours If-Match refused a range of an object replaced since the fetch began."""
    if response.status == 412:
        raise Changed(f"{url}: changed on the server since the fetch began (412 to a range pinned to its ETag)")
    if response.status in _PERMANENT:
        raise TransferError(f"{url}: HTTP {response.status} {response.reason}")
    if response.status >= 400:
        raise OSError(f"{url}: HTTP {response.status} {response.reason}")


def _size_header(response: urllib3.BaseHTTPResponse, name: str, url: str) -> int | None:
    """The byte count header ``name`` holds; None when absent; TransferError when it is no size."""
    value = response.headers.get(name)
    if value is None:
        return None
    value = value.strip()
    if not _DIGITS.fullmatch(value) or int(value) > MAX_SIZE_BYTES:
        raise TransferError(f"{url}: the server's {name} {value[:40]!r} is not a file's size")
    return int(value)


def _content_range(response: urllib3.BaseHTTPResponse, url: str) -> tuple[int, int, int | None]:
    """A 206's Content-Range: (first, past the last, total or None where the server says *)."""
    text = response.headers.get("Content-Range", "")
    match = _CONTENT_RANGE.fullmatch(text.strip())
    if not match or int(match.group(2)) < int(match.group(1)):
        raise TransferError(f"{url}: the server's Content-Range {text[:60]!r} is malformed")
    total = None if match.group(3) == "*" else int(match.group(3))
    if total is not None and (total > MAX_SIZE_BYTES or int(match.group(2)) >= total):
        raise TransferError(f"{url}: the server's Content-Range {text[:60]!r} is malformed")
    return int(match.group(1)), int(match.group(2)) + 1, total


def _strong_etag(response: urllib3.BaseHTTPResponse) -> str | None:
    etag = response.headers.get("ETag")
    return None if not etag or etag.startswith("W/") else etag  # a weak one cannot guard ranges (RFC 9110 13.1.5)


class HttpSource(Source):
    def __init__(self, url: str, pools: Pools, display: str | None = None) -> None:
        self.url = url
        self.display = display or url
        self.pools = pools
        self.endpoint = endpoint_of(url)

    def request_url(self, remote: Remote | None = None) -> str:
        """The URL each request goes to (an object store's source signs a fresh one per request, for the
        version ``remote`` names where the store keeps versions)."""
        return self.url

    def pinned(self, remote: Remote) -> dict[str, str]:
        """Headers that make the server itself refuse another version of the file (an object store's)."""
        return {}

    def connect(self) -> None:
        self.pools.connect(self.endpoint)

    def _get(self, headers: dict[str, str], remote: Remote | None = None) -> urllib3.BaseHTTPResponse:
        return self.pools.request("GET", self.request_url(remote), headers, display=self.display)

    def stat(self) -> Remote:
        """A one-byte ranged GET rather than HEAD: it says whether ranges are honoured, and some servers
        (and presigned URLs, which are signed for GET) refuse HEAD."""
        response = self._get({"Range": "bytes=0-0", "Accept-Encoding": "identity"})
        try:
            check_status(response, self.display)
            etag, modified = _strong_etag(response), _http_time(response.headers.get("Last-Modified"))
            if response.status == 206:
                _size_header(response, "Content-Length", self.display)  # a malformed one is said here, once
                total = _content_range(response, self.display)[2]
                if total is None:
                    raise TransferError(f"{self.display}: the server's Content-Range gives no size")
                return Remote(self.display, total, etag, modified, ranged=True)
            if response.status != 200:
                raise TransferError(f"{self.display}: the server answered {response.status} to a GET")
            length = _size_header(response, "Content-Length", self.display)
            return Remote(self.display, length, etag, modified, ranged=False)
        finally:
            # a one-byte range is read to its end and the connection kept; anything longer (a whole file sent
            # by a server without ranges, or a body that does not end) is closed unread
            _done_with(response, drain=response.status == 206 and response.headers.get("Content-Length") == "1")

    def read(self, remote: Remote, start: int, end: int | None, sink: Sink) -> None:
        """Bytes [start, end) of ``remote`` to ``sink``; ``end`` None: to the end of a file of unknown size."""
        headers = {"Accept-Encoding": "identity", **self.pinned(remote)}
        if remote.ranged:
            end = read_end(remote, end)  # a file served in ranges has a known size (its stat's Content-Range)
            headers["Range"] = f"bytes={start}-{end - 1}"
            validator = remote.etag or (
                email.utils.formatdate(remote.last_modified, usegmt=True) if remote.last_modified else None
            )
            if validator:
                headers["If-Range"] = validator
        response = self._get(headers, remote)
        try:
            check_status(response, self.display)
            skip = self._check_answer(response, remote, start, end)
            self._deliver(response, skip, (end - start) if end is not None else None, sink)
        except BaseException:
            _done_with(response, drain=False)
            raise
        _done_with(response, drain=True)

    def _check_answer(self, response: urllib3.BaseHTTPResponse, remote: Remote, start: int, end: int | None) -> int:
        """That the answer is of the file the fetch began on and holds [start, end): the bytes before
        ``start`` it holds (a whole file sent where a range was asked, or by a server without ranges)."""
        if response.status == 206 and remote.ranged:
            first, past, total = _content_range(response, self.display)
            self._check_same(response, remote, total)
            if (first, past) != (start, end):
                raise TransferError(f"{self.display}: the server answered another range ({first}-{past - 1})")
            if _size_header(response, "Content-Length", self.display) not in (None, past - first):
                raise TransferError(f"{self.display}: the server's Content-Length is not that of the range it sent")
            return 0
        if response.status != 200:
            raise TransferError(f"{self.display}: the server answered {response.status} to a GET of the file")
        self._check_same(response, remote, _size_header(response, "Content-Length", self.display))
        if remote.ranged and (start, end) != (0, remote.size):
            raise Changed(
                f"{self.display}: changed on the server since the fetch began (it answered a range guarded by "
                "its validator with the whole file)"
            )
        return start

    def _check_same(self, response: urllib3.BaseHTTPResponse, remote: Remote, size: int | None) -> None:
        """Changed when this answer's validators are not those the fetch began on: the file was replaced."""
        found = {
            "ETag": (remote.etag, _strong_etag(response)),
            "Last-Modified": (remote.last_modified, _http_time(response.headers.get("Last-Modified"))),
            "size": (remote.size, size),
        }
        for name, (began, now) in found.items():
            # a size left out is counted as the bytes come instead (a chunked answer); a validator left out is
            # not the same answer (RFC 9110 15.3.7: a 206 carries those a 200 would)
            if began is not None and now != began and (name != "size" or now is not None):
                raise Changed(
                    f"{self.display}: changed on the server during the fetch ({name} {began} -> {now}); "
                    "nothing of the new version was kept: run again to fetch it anew"
                )

    def _deliver(self, response: urllib3.BaseHTTPResponse, skip: int, wanted: int | None, sink: Sink) -> None:
        """The answer's bytes after the first ``skip`` to ``sink``: exactly ``wanted`` of them, or all when
        ``wanted`` is None. read1: what has arrived, up to a piece, at once (read() would wait for a whole
        piece), so a stream whose tail another took stops within a few packets of the point where it began."""
        received = 0
        while piece := response.read1(PIECE_BYTES, decode_content=False):
            if skip:
                dropped = min(skip, len(piece))
                piece, skip = piece[dropped:], skip - dropped
            received += len(piece)
            if wanted is not None and received > wanted:
                raise Changed(f"{self.display}: the server sent more bytes than the file holds")
            if piece:
                sink(piece)
        if wanted is not None and received != wanted:
            raise OSError(f"{self.display}: connection closed after {received} of {wanted} bytes")


def _done_with(response: urllib3.BaseHTTPResponse, drain: bool) -> None:
    """Give the connection back: read to the end what is short (so it can carry the next request), close
    what is not (a whole file the server sent instead of a range must not be read to the end here)."""
    if drain:
        try:
            response.drain_conn()
        except (OSError, urllib3.exceptions.HTTPError):
            response.close()
    else:
        response.close()
    response.release_conn()
