"""What every endpoint a transfer reads from gives the engine: a stat, and byte ranges.

A ``Source`` is one remote file. ``stat()`` gives its size and the validators that say whether it is still the
same file (ETag, Last-Modified), and a whole-file checksum where the store keeps one; ``read(remote, start,
end, sink)`` hands bytes [start, end) to ``sink`` as they arrive, and raises ``Changed`` when the file is no
longer the one ``remote`` describes. Errors a retry cannot fix (no such file, no permission, the file changed)
are ``TransferError``; anything else (a reset, a timeout, a 503) is worth a retry.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from redline.errors import RedlineError

Sink = Callable[[bytes], None]
PIECE_BYTES = 1 << 20  # what a read hands the sink at a time


class TransferError(RedlineError):
    """A file cannot be moved, and retrying will not change that."""


class Changed(TransferError):
    """The remote file is not the one the transfer started on (its validators or size differ)."""


@dataclass(frozen=True)
class Remote:
    url: str
    size: int | None  # None: the server gives no length (a chunked answer); known once it is read
    etag: str | None = None
    last_modified: float | None = None  # seconds since the epoch
    checksum: tuple[str, str] | None = None  # ("sha256", hex) of the whole file, where the store keeps one
    version: str | None = None  # the object version an S3 bucket with versioning gives: its bytes never change
    ranged: bool = True  # honours byte ranges; when not, the file comes in one piece, over one stream

    def validators(self) -> dict:
        return {"size": self.size, "etag": self.etag, "last_modified": self.last_modified}


@dataclass(frozen=True)
class Sockets:
    """How a transfer's TCP connections are made: timeouts fit for a long link (a read timeout, no total
    one: a 50 GiB file over 100 Mbit/s takes over an hour and must not be cut), and the congestion control
    each socket asks for (where the kernel allows it)."""

    connect_timeout_s: float = 30.0
    read_timeout_s: float = 60.0
    congestion: str | None = None

    def options(self) -> list[tuple[int, int, int | bytes]]:
        out: list[tuple[int, int, int | bytes]] = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        if self.congestion:
            out.append((socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.congestion.encode()))
        return out

    def connect(self, host: str, port: int) -> socket.socket:
        sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        for level, name, value in self.options():
            sock.setsockopt(level, name, value)
        sock.settimeout(self.read_timeout_s)
        return sock


@dataclass(frozen=True)
class Credentials:
    """What the stores' logins take beyond their own defaults, one object for a transfer: each scheme reads its
    own fields (``schemes``). None: the store's client finds its own (boto3's configuration, ssh's keys)."""

    endpoint_url: str | None = None  # S3: the API's endpoint (MinIO, R2...); the keys are boto3's
    known_hosts: Path | None = None  # SFTP: host keys trusted besides ~/.ssh/known_hosts
    key_file: Path | None = None  # SFTP: the private key; None: ssh's keys and the agent


def congestion_allowed(name: str) -> bool:
    """Whether this process may set ``name`` on its sockets (root: any algorithm the kernel has or can
    load; others: those in net.ipv4.tcp_allowed_congestion_control)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError:
            return False
    return True


def read_end(remote: Remote, end: int | None) -> int:
    """Where a read of ``remote`` up to ``end`` stops: ``end``, or the file's size when None (to its end); for a
    source that must know the end before it reads. TransferError when neither is known."""
    if end is not None:
        return end
    if remote.size is None:
        raise TransferError(f"{remote.url}: its length is unknown, and this source reads only up to a known end")
    return remote.size


class Source(ABC):
    """One remote file to read."""

    url: str
    endpoint: str  # what per-endpoint connection caps count: scheme://host:port

    @abstractmethod
    def stat(self) -> Remote: ...

    @abstractmethod
    def read(self, remote: Remote, start: int, end: int | None, sink: Sink) -> None:
        """Bytes [start, end) of ``remote`` to ``sink`` as they arrive; ``end`` None: to the end of the file (how
        one of unknown length, ``Remote.size`` None, is read)."""

    def connect(self) -> None:  # noqa: B027 - a source with no connections of its own has nothing to open
        """Open a connection ahead of the first read, where this kind of source keeps them: a stream calls it
        while the file is being stat'ed, so on a long link its first request does not wait a handshake more."""

    def close(self) -> None:  # noqa: B027 - most sources hold nothing of their own
        """Free connections this source holds (shared pools are the session's to close)."""
