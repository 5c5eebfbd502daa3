"""SFTP sources and destinations over SSH (paramiko): one SSH connection per worker thread.

SFTP moves a file in 32 KiB requests; one connection keeping a few requests in flight is bound by them per
RTT (rclone's SFTP at 100 ms RTT: rclone#1158), so each range is read with many requests in flight
(paramiko's readv pipelines them) and ranges run on separate connections, each its own TCP stream.

Host keys are checked as ssh does: against ~/.ssh/known_hosts (and ``known_hosts`` when given); an unknown
host is refused, never trusted on first sight. Keys and the agent are paramiko's defaults, or ``key_file``.
"""

from __future__ import annotations

import getpass
import stat as stat_mode
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from redline.capability import is_available
from redline.transfer.source import PIECE_BYTES, Changed, Remote, Sink, Sockets, Source, TransferError, read_end

if TYPE_CHECKING:
    from paramiko import SFTPClient, SSHClient

    from redline.transfer.session import Session
    from redline.transfer.upload import SftpDestination

IN_FLIGHT = 128  # 32 KiB requests outstanding per connection: 4 MiB, 160 Mbit/s at 200 ms


@dataclass(frozen=True)
class Address:
    user: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> Address:
        parts = urlsplit(url)
        if parts.scheme != "sftp" or not parts.hostname:
            raise TransferError(f"{url}: not an sftp://[user@]host[:port]/path URL")
        return cls(parts.username or getpass.getuser(), parts.hostname, parts.port or 22, unquote(parts.path) or "/")

    @property
    def endpoint(self) -> str:
        return f"sftp://{self.user}@{self.host}:{self.port}"


class SshPool:
    """SSH connections of one transfer: one per (thread, server), all closed together."""

    def __init__(self, sockets: Sockets, known_hosts: Path | None = None, key_file: Path | None = None) -> None:
        if not is_available("paramiko"):
            raise TransferError("sftp:// URLs need paramiko (pip install paramiko, the sftp extra)")
        self.sockets, self.known_hosts, self.key_file = sockets, known_hosts, key_file
        self._local = threading.local()
        self._all: list[SSHClient] = []
        self._lock = threading.Lock()

    def sftp(self, address: Address) -> SFTPClient:
        """This thread's SFTP session to ``address``'s server, opened on first use."""
        sessions = self._local.__dict__.setdefault("sessions", {})
        key = (address.user, address.host, address.port)
        if key not in sessions:
            sessions[key] = self._open(address)
        return sessions[key]

    def _open(self, address: Address) -> SFTPClient:
        import paramiko

        client = paramiko.SSHClient()
        client.load_system_host_keys()
        if self.known_hosts:
            client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            sock = self.sockets.connect(address.host, address.port)
            client.connect(
                address.host,
                address.port,
                username=address.user,
                key_filename=str(self.key_file) if self.key_file else None,
                sock=sock,
                timeout=self.sockets.connect_timeout_s,
                banner_timeout=self.sockets.connect_timeout_s,
                auth_timeout=self.sockets.connect_timeout_s,
            )
        except paramiko.BadHostKeyException:
            raise TransferError(f"{address.endpoint}: its host key differs from the one known_hosts holds") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise TransferError(
                    f"{address.endpoint}: unknown host key; add it first (ssh-keyscan -p {address.port} "
                    f"{address.host} >> ~/.ssh/known_hosts, after checking it)"
                ) from None
            if isinstance(exc, paramiko.AuthenticationException):
                raise TransferError(f"{address.endpoint}: authentication failed ({exc})") from None
            raise OSError(f"{address.endpoint}: {exc}") from None
        session = client.open_sftp()
        channel = session.get_channel()
        if channel is None:  # open_sftp opens its session on a channel: none would be paramiko's fault
            raise OSError(f"{address.endpoint}: the SFTP session came without its SSH channel")
        channel.settimeout(self.sockets.read_timeout_s)
        with self._lock:
            self._all.append(client)
        return session

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            client.close()


def ssh_pool(session: Session) -> SshPool:
    """The transfer's SSH connections, made with the session's ``known_hosts`` and ``key_file``."""
    credentials = session.credentials
    return session.shared("sftp", lambda: SshPool(session.sockets, credentials.known_hosts, credentials.key_file))


def open_source(session: Session, url: str) -> SftpSource:
    return SftpSource(url, ssh_pool(session))


def open_listing(session: Session, url: str) -> list[tuple[str, str]]:
    """``listing`` with the session's ``copy_links``; the entries left out go to the session's ``skipped``."""
    files, skipped = listing(ssh_pool(session), url, session.copy_links)
    session.skipped += [f"{url.rstrip('/')}/{name}" for name in skipped]
    return files


def open_destination(session: Session, url: str) -> SftpDestination:
    from redline.transfer.upload import SftpDestination

    return SftpDestination(ssh_pool(session), Address.parse(url))


def _missing(exc: OSError, url: str) -> TransferError | None:
    if isinstance(exc, FileNotFoundError):
        return TransferError(f"{url}: no such file")
    if isinstance(exc, PermissionError):
        return TransferError(f"{url}: permission denied")
    return None


class SftpSource(Source):
    def __init__(self, url: str, pool: SshPool) -> None:
        self.url, self.pool = url, pool
        self.address = Address.parse(url)
        self.endpoint = self.address.endpoint

    def stat(self) -> Remote:
        try:
            info = self.pool.sftp(self.address).stat(self.address.path)
        except OSError as exc:
            raise _missing(exc, self.url) or exc from None
        if stat_mode.S_ISDIR(info.st_mode or 0):
            raise TransferError(f"{self.url}: a directory (end the URL with / to fetch what it holds)")
        if info.st_size is None or info.st_mtime is None:  # optional in SFTP; the validators are these two
            raise TransferError(f"{self.url}: the server gives no size or modification time for it")
        return Remote(self.url, int(info.st_size), last_modified=float(info.st_mtime))

    def read(self, remote: Remote, start: int, end: int | None, sink: Sink) -> None:
        stop = read_end(remote, end)
        session = self.pool.sftp(self.address)
        with session.open(self.address.path, "rb") as f:
            info = f.stat()
            modified = float(info.st_mtime) if info.st_mtime is not None else None
            if (info.st_size, modified) != (remote.size, remote.last_modified):
                raise Changed(f"{self.url}: changed on the server since the transfer began; run again")
            pieces = [(offset, min(PIECE_BYTES, stop - offset)) for offset in range(start, stop, PIECE_BYTES)]
            for (_, length), piece in zip(pieces, f.readv(pieces, IN_FLIGHT), strict=True):
                if len(piece) != length:
                    raise Changed(f"{self.url}: shorter than when the transfer began")
                sink(piece)


def listing(pool: SshPool, url: str, follow: bool = False) -> tuple[list[tuple[str, str]], list[str]]:
    """Every regular file below the directory ``url`` names (its URL, its path below that directory), and the
    entries left out with why: symlinks unless ``follow``, as a local folder's (``fs.walk_local``)."""
    address = Address.parse(url)
    session = pool.sftp(address)
    base = address.path.rstrip("/")
    out: list[tuple[str, str]] = []
    skipped: list[str] = []
    pending: list[tuple[str, frozenset]] = [("", frozenset())]  # each folder with the real paths above it
    prefix = url.rstrip("/")
    while pending:
        relative, above = pending.pop()
        folder = f"{base}/{relative}".rstrip("/") or "/"
        try:
            real = session.normalize(folder)
            entries = [] if real in above else session.listdir_attr(folder)
        except OSError as exc:
            raise _missing(exc, url) or TransferError(f"{url}: cannot list: {exc}") from None
        if real in above:
            skipped.append(f"{relative} (a link to a folder above it)")
        above = above | {real}
        for entry in sorted(entries, key=lambda e: e.filename):
            name = f"{relative}/{entry.filename}".lstrip("/")
            mode = entry.st_mode or 0
            if stat_mode.S_ISLNK(mode):
                if not follow:
                    skipped.append(f"{name} (a symlink)")
                    continue
                mode = _target_mode(session, f"{base}/{name}")
            if stat_mode.S_ISDIR(mode):
                pending.append((name, above))
            elif stat_mode.S_ISREG(mode):
                out.append((f"{prefix}/{name}", name))
            else:
                skipped.append(f"{name} ({'a broken symlink' if mode == 0 else 'not a regular file'})")
    return sorted(out, key=lambda item: item[1]), sorted(skipped)


def _target_mode(session: SFTPClient, path: str) -> int:
    """The mode of what the symlink ``path`` points to; 0 when it points nowhere."""
    try:
        return session.stat(path).st_mode or 0
    except OSError:
        return 0
