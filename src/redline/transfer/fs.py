"""Filesystem sources: a path (local disk, or a network mount: NFS, Ceph, a FUSE bucket) read with parallel
positional reads, and any other fsspec URL (hdfs://, gs://, az://...) through fsspec when it is installed.

A network filesystem serves one reader at the latency of a round trip per request; several readers at
different offsets keep the link busy, as parallel HTTP ranges do. The validators are size and mtime.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from redline.capability import is_available
from redline.files import kind_of
from redline.transfer.source import PIECE_BYTES, Changed, Remote, Sink, Source, TransferError, read_end

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from redline.transfer.session import Session


class LocalSource(Source):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = str(path)
        self.endpoint = f"file://{_mount_of(path)}"

    def stat(self) -> Remote:
        fd = self._open()
        try:
            info = os.fstat(fd)
        finally:
            os.close(fd)
        return Remote(self.url, info.st_size, etag=None, last_modified=info.st_mtime)

    def _open(self) -> int:
        """The file, opened without blocking (a FIFO opens at once) and refused unless regular: a FIFO, a
        device (/dev/zero reads without end, /dev/null as nothing) or a folder is not a file to copy."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TransferError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise TransferError(f"{self.path}: {exc.strerror}") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise TransferError(f"{self.path}: {kind_of(mode)}, not a regular file; fetch copies regular files")
        os.set_blocking(fd, True)
        return fd

    def read(self, remote: Remote, start: int, end: int | None, sink: Sink) -> None:
        stop = read_end(remote, end)
        with open(self._open(), "rb", buffering=0) as f:
            info = os.fstat(f.fileno())
            if (info.st_size, info.st_mtime) != (remote.size, remote.last_modified):
                raise Changed(f"{self.path}: changed since the transfer began; run again to copy it anew")
            offset = start
            while offset < stop:
                piece = os.pread(f.fileno(), min(PIECE_BYTES, stop - offset), offset)
                if not piece:
                    raise Changed(f"{self.path}: shorter than when the transfer began")
                sink(piece)
                offset += len(piece)


def local_path(url: str) -> Path:
    """The path a plain path or a file:// URL names."""
    parts = urlsplit(url)
    return Path(unquote(parts.path)) if parts.scheme == "file" else Path(url)


def open_local(session: Session, url: str) -> LocalSource:
    return LocalSource(local_path(url))


def local_listing(session: Session, url: str) -> list[tuple[str, str]]:
    """The regular files below the folder ``url`` names (``walk_local`` with the session's ``copy_links``); the
    entries left out go to the session's ``skipped``."""
    root = local_path(url)
    found, skipped = walk_local(root, session.copy_links)
    session.skipped += [f"{root / name}" for name in skipped]
    return [(str(path), name) for path, name in found]


def walk_local(root: Path, follow: bool) -> tuple[list[tuple[Path, str]], list[str]]:
    """The regular files below the folder ``root`` (each with its path below it, sorted) and the entries left
    out, each with why. A symlink is left out unless ``follow`` (rclone's rule: skipped with a notice, followed
    with -L/--copy-links; the SFTP listing keeps the same one); a link back to a folder above it is not walked
    again (a loop); FIFOs, devices and sockets are never files to copy."""
    files: list[tuple[Path, str]] = []
    skipped: list[str] = []
    pending: list[tuple[Path, frozenset]] = [(root, frozenset())]
    while pending:
        folder, above = pending.pop()
        info = os.stat(folder)
        if (info.st_dev, info.st_ino) in above:
            skipped.append(f"{folder.relative_to(root).as_posix()} (a link to a folder above it)")
            continue
        above = above | {(info.st_dev, info.st_ino)}
        with os.scandir(folder) as entries:
            for entry in entries:
                path = Path(entry.path)
                relative = path.relative_to(root).as_posix()
                if entry.is_symlink() and not follow:
                    skipped.append(f"{relative} (a symlink)")
                elif entry.is_dir():
                    pending.append((path, above))
                elif entry.is_file():
                    files.append((path, relative))
                else:
                    skipped.append(f"{relative} ({_kind(path)})")
    return sorted(files, key=lambda item: item[1]), sorted(skipped)


def _kind(path: Path) -> str:
    try:
        return kind_of(os.stat(path).st_mode)
    except OSError:
        return "a broken symlink"


def _mount_of(path: Path) -> str:
    """The mount point holding ``path``: each filesystem is an endpoint of its own for the caps."""
    current = path.resolve().parent if not path.is_dir() else path.resolve()
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return str(current)


class FsspecSource(Source):
    """Any URL fsspec knows; ``fs`` is shared by a transfer's sources of one protocol."""

    def __init__(self, url: str, fs: AbstractFileSystem, path: str) -> None:
        self.url, self.fs, self.path = url, fs, path
        self.endpoint = f"{fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]}://"

    def stat(self) -> Remote:
        try:
            info = self.fs.info(self.path)
        except FileNotFoundError:
            raise TransferError(f"{self.url}: no such file") from None
        if info.get("type") == "directory":
            raise TransferError(f"{self.url}: a directory (end the URL with / to fetch what it holds)")
        etag = info.get("ETag") or info.get("etag")
        modified = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
        if hasattr(modified, "timestamp"):
            modified = modified.timestamp()
        return Remote(self.url, int(info["size"]), etag=etag, last_modified=modified)

    def read(self, remote: Remote, start: int, end: int | None, sink: Sink) -> None:
        stop = read_end(remote, end)
        offset = start
        while offset < stop:
            piece = self.fs.cat_file(self.path, start=offset, end=min(stop, offset + PIECE_BYTES))
            if not piece:
                raise Changed(f"{self.url}: shorter than when the transfer began")
            sink(piece)
            offset += len(piece)


def fsspec_filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """(fs, path) for ``url``; a TransferError, one line, when fsspec or the protocol's package is missing."""
    if not is_available("fsspec"):
        raise TransferError(f"{url}: this kind of URL needs fsspec (pip install fsspec)")
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError, OSError) as exc:  # a filesystem that connects when made (ftp://) may fail so
        raise TransferError(f"{url}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}") from None


def fsspec_knows(scheme: str) -> bool:
    """Whether fsspec (when installed) has a filesystem for ``scheme``."""
    if not is_available("fsspec"):
        return False
    import fsspec

    return scheme in fsspec.available_protocols()


def open_fsspec(session: Session, url: str) -> FsspecSource:
    filesystem, path = fsspec_filesystem(url)
    return FsspecSource(url, filesystem, path)


def fsspec_listing(session: Session, url: str) -> list[tuple[str, str]]:
    """Every file below the folder ``url`` names, through its fsspec filesystem."""
    filesystem, path = fsspec_filesystem(url)
    base = path.rstrip("/")
    protocol = filesystem.protocol if isinstance(filesystem.protocol, str) else filesystem.protocol[0]
    return sorted((f"{protocol}://{name}", name[len(base) + 1 :]) for name in filesystem.find(base))
