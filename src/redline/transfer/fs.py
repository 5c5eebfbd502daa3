"""Filesystem sources: a path (local disk, or a network mount: NFS, Ceph, a FUSE bucket) read with parallel
positional reads, and any other fsspec URL (hdfs://, gs://, az://...) through fsspec when it is installed.

A network filesystem serves one reader at the latency of a round trip per request; several readers at
different offsets keep the link busy, as parallel HTTP ranges do. The validators are size and mtime.
"""

from __future__ import annotations

import os
from pathlib import Path

from redline.capability import is_available
from redline.transfer.source import PIECE_BYTES, Changed, Remote, Sink, Source, TransferError


class LocalSource(Source):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = str(path)
        self.endpoint = f"file://{_mount_of(path)}"

    def stat(self) -> Remote:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            raise TransferError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise TransferError(f"{self.path}: {exc.strerror}") from None
        return Remote(self.url, info.st_size, etag=None, last_modified=info.st_mtime)

    def read(self, remote: Remote, start: int, end: int, sink: Sink) -> None:
        with open(self.path, "rb", buffering=0) as f:
            info = os.fstat(f.fileno())
            if (info.st_size, info.st_mtime) != (remote.size, remote.last_modified):
                raise Changed(f"{self.path}: changed since the transfer began; run again to copy it anew")
            offset = start
            while offset < end:
                piece = os.pread(f.fileno(), min(PIECE_BYTES, end - offset), offset)
                if not piece:
                    raise Changed(f"{self.path}: shorter than when the transfer began")
                sink(piece)
                offset += len(piece)


def _mount_of(path: Path) -> str:
    """The mount point holding ``path``: each filesystem is an endpoint of its own for the caps."""
    current = path.resolve().parent if not path.is_dir() else path.resolve()
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return str(current)


class FsspecSource(Source):
    """Any URL fsspec knows; ``fs`` is shared by a transfer's sources of one protocol."""

    def __init__(self, url: str, fs, path: str) -> None:
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

    def read(self, remote: Remote, start: int, end: int, sink: Sink) -> None:
        offset = start
        while offset < end:
            piece = self.fs.cat_file(self.path, start=offset, end=min(end, offset + PIECE_BYTES))
            if not piece:
                raise Changed(f"{self.url}: shorter than when the transfer began")
            sink(piece)
            offset += len(piece)


def fsspec_filesystem(url: str):
    """(fs, path) for ``url``; a TransferError, one line, when fsspec or the protocol's package is missing."""
    if not is_available("fsspec"):
        raise TransferError(f"{url}: this kind of URL needs fsspec (pip install fsspec)")
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise TransferError(f"{url}: {exc}") from None
