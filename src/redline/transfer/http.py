"""HTTP(S) sources: ranged GETs through one urllib3 pool per endpoint.

A range request carries ``If-Range`` with the validator the transfer started on, so a file replaced on the
server mid-transfer answers 200 with the new file instead of a 206 splicing two versions together: that, or a
Content-Range of another size, is ``Changed``. ``Accept-Encoding: identity`` keeps byte offsets those of the
file itself. No redirect is followed blindly: urllib3 follows them (presigned object-store URLs redirect).
"""

from __future__ import annotations

import email.utils
import re
from urllib.parse import urlsplit

import urllib3

from redline.transfer.source import PIECE_BYTES, Changed, Remote, Sink, Sockets, Source, TransferError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
# a retry will not help these; 408, 425, 429 and 5xx are worth one
_PERMANENT = {400, 401, 403, 404, 405, 410, 411, 414, 451}


class Pools:
    """One urllib3 pool manager per transfer: connections kept alive per endpoint, at most ``per_endpoint``
    of them, the sockets made as ``sockets`` says."""

    def __init__(self, sockets: Sockets, per_endpoint: int) -> None:
        self.sockets = sockets
        self._manager = urllib3.PoolManager(
            num_pools=64,
            maxsize=per_endpoint,
            block=True,  # a request waits for a free connection rather than opening one past the cap
            retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5, raise_on_redirect=True),
            timeout=urllib3.Timeout(connect=sockets.connect_timeout_s, read=sockets.read_timeout_s),
            socket_options=sockets.options(),
        )

    def request(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None):
        return self._manager.request(method, url, headers=headers, body=body, preload_content=False)

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


def endpoint_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _http_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def check_status(response, url: str) -> None:
    """A status a retry cannot fix is a TransferError naming it; others (5xx, 429) raise for a retry."""
    if response.status in _PERMANENT:
        raise TransferError(f"{url}: HTTP {response.status} {response.reason}")
    if response.status >= 400:
        raise OSError(f"{url}: HTTP {response.status} {response.reason}")


class HttpSource(Source):
    def __init__(self, url: str, pools: Pools, display: str | None = None) -> None:
        self.url = url
        self.display = display or url
        self.pools = pools
        self.endpoint = endpoint_of(url)

    def request_url(self) -> str:
        """The URL each request goes to (an object store's source signs a fresh one per request)."""
        return self.url

    def connect(self) -> None:
        self.pools.connect(self.endpoint)

    def stat(self) -> Remote:
        """A one-byte ranged GET rather than HEAD: it says whether ranges are honoured, and some servers
        (and presigned URLs, which are signed for GET) refuse HEAD."""
        response = self.pools.request("GET", self.request_url(), {"Range": "bytes=0-0", "Accept-Encoding": "identity"})
        try:
            check_status(response, self.display)
            headers = response.headers
            etag = headers.get("ETag")
            if etag and etag.startswith("W/"):
                etag = None  # a weak validator cannot guard byte ranges (RFC 9110 13.1.5)
            modified = _http_time(headers.get("Last-Modified"))
            if response.status == 206:
                match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", ""))
                if not match or match.group(3) == "*":
                    raise TransferError(f"{self.display}: the server's Content-Range gives no size")
                return Remote(self.display, int(match.group(3)), etag, modified, ranged=True)
            length = headers.get("Content-Length")
            if length is None:
                raise TransferError(f"{self.display}: the server gives neither ranges nor a length")
            return Remote(self.display, int(length), etag, modified, ranged=False)
        finally:
            _done_with(response, drain=response.status == 206)

    def read(self, remote: Remote, start: int, end: int, sink: Sink) -> None:
        headers = {"Accept-Encoding": "identity"}
        if remote.ranged:
            headers["Range"] = f"bytes={start}-{end - 1}"
            validator = remote.etag or (
                email.utils.formatdate(remote.last_modified, usegmt=True) if remote.last_modified else None
            )
            if validator:
                headers["If-Range"] = validator
        response = self.pools.request("GET", self.request_url(), headers)
        try:
            check_status(response, self.display)
            if remote.ranged:
                self._check_range(response, remote, start, end)
            elif start != 0 or end != remote.size:
                raise TransferError(f"{self.display}: the server does not serve byte ranges")
            received = 0
            # read1: what has arrived, up to a piece, at once (read() would wait for a whole piece): a stream
            # whose tail another took stops within a few packets of the point where that one began
            while piece := response.read1(PIECE_BYTES, decode_content=False):
                received += len(piece)
                if received > end - start:
                    raise Changed(f"{self.display}: the server sent more bytes than the range holds")
                sink(piece)
            if received != end - start:
                raise OSError(f"{self.display}: connection closed after {received} of {end - start} bytes")
        except BaseException:
            _done_with(response, drain=False)
            raise
        _done_with(response, drain=True)

    def _check_range(self, response, remote: Remote, start: int, end: int) -> None:
        if response.status != 206:
            if response.status == 200 and start == 0 and end == remote.size and _same(response, remote):
                return  # the whole file asked for as one range: a 200 of the same file is that range
            raise Changed(
                f"{self.display}: changed on the server since the transfer began (answered "
                f"{response.status} to a range guarded by its validator); run again to fetch it anew"
            )
        match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
        if not match or (int(match.group(1)), int(match.group(2)) + 1) != (start, end):
            raise Changed(
                f"{self.display}: the server answered another range ({response.headers.get('Content-Range')})"
            )
        if match.group(3) != "*" and int(match.group(3)) != remote.size:
            raise Changed(f"{self.display}: its size changed on the server since the transfer began")


def _done_with(response, drain: bool) -> None:
    """Give the connection back: read to the end what is short (so it can carry the next request), close
    what is not (a whole file the server sent instead of a range must not be read to the end here)."""
    if drain:
        response.drain_conn()
    else:
        response.close()
    response.release_conn()


def _same(response, remote: Remote) -> bool:
    etag = response.headers.get("ETag")
    return (remote.etag is None or etag == remote.etag) and int(
        response.headers.get("Content-Length", -1)
    ) == remote.size
