"""From the URLs a user typed to the files to move: which kind of endpoint each is, what a folder or prefix
holds, and where each file lands.

A URL ending in ``/`` (or a local directory) stands for every file below it; each lands under DEST at its
path below that URL. One source file and a DEST that is not a directory: DEST is the file. A listing's
names never leave DEST: a path with ``..`` or a leading ``/`` is refused (a hostile server must not write
elsewhere on this machine). A folder's symlinks, local or over SFTP, are skipped and said unless
``copy_links`` (rclone's rule). A URL of an unknown scheme or with a port out of range, a source that is not
a regular file (a FIFO, ``/dev/zero``) and a DEST that is neither a regular file nor a folder (a symlink, a
device) are BadInput before anything moves.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from redline.errors import BadInput
from redline.files import refuse_non_regular
from redline.transfer.engine import Item
from redline.transfer.fs import FsspecSource, LocalSource, fsspec_filesystem, fsspec_knows, walk_local
from redline.transfer.http import HttpSource, Pools, host_port
from redline.transfer.landing import refusal
from redline.transfer.source import Sockets, Source, TransferError

OWN_SCHEMES = ("http", "https", "s3", "sftp", "file")


class Session:
    """The connections a transfer shares: HTTP pools, SSH connections, an S3 client, fsspec filesystems;
    each made on first use, all closed by ``close()``."""

    def __init__(
        self,
        sockets: Sockets,
        per_endpoint: int,
        endpoint_url: str | None = None,
        known_hosts: Path | None = None,
        key_file: Path | None = None,
        copy_links: bool = False,
    ) -> None:
        self.sockets, self.per_endpoint, self.copy_links = sockets, per_endpoint, copy_links
        self.skipped: list[str] = []  # entries of the folders listed that are not moved, each with why
        self.endpoint_url, self.known_hosts, self.key_file = endpoint_url, known_hosts, key_file
        self._pools: Pools | None = None
        self._ssh = None
        self._s3 = None

    @property
    def pools(self) -> Pools:
        if self._pools is None:
            self._pools = Pools(self.sockets, self.per_endpoint)
        return self._pools

    @property
    def ssh(self):
        if self._ssh is None:
            from redline.transfer.sftp import SshPool

            self._ssh = SshPool(self.sockets, self.known_hosts, self.key_file)
        return self._ssh

    @property
    def s3(self):
        if self._s3 is None:
            from redline.transfer import s3

            self._s3 = s3.client(self.endpoint_url, self.per_endpoint)
        return self._s3

    def source(self, url: str) -> Source:
        check_url(url)
        scheme = kind(url)
        if scheme in ("http", "https"):
            return HttpSource(url, self.pools)
        if scheme == "s3":
            from redline.transfer.s3 import S3Source

            return S3Source(url, self.s3, self.pools)
        if scheme == "sftp":
            from redline.transfer.sftp import SftpSource

            return SftpSource(url, self.ssh)
        if scheme == "file":
            return LocalSource(local_path(url))
        fs, path = fsspec_filesystem(url)
        return FsspecSource(url, fs, path)

    def listing(self, url: str) -> list[tuple[str, str]]:
        """The files below a folder URL: (URL, path below it)."""
        scheme = kind(url)
        if scheme in ("http", "https"):
            raise BadInput(f"{url}: an HTTP server gives no listing to fetch; name the files")
        if scheme == "s3":
            from redline.transfer import s3

            return s3.listing(self.s3, url)
        if scheme == "sftp":
            from redline.transfer import sftp

            files, skipped = sftp.listing(self.ssh, url, self.copy_links)
            self.skipped += [f"{url.rstrip('/')}/{name}" for name in skipped]
            return files
        if scheme == "file":
            root = local_path(url)
            found, skipped = walk_local(root, self.copy_links)
            self.skipped += [f"{root / name}" for name in skipped]
            return [(str(path), name) for path, name in found]
        fs, path = fsspec_filesystem(url)
        base = path.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return sorted((f"{protocol}://{name}", name[len(base) + 1 :]) for name in fs.find(base))

    def close(self) -> None:
        if self._pools is not None:
            self._pools.close()
        if self._ssh is not None:
            self._ssh.close()


def kind(url: str) -> str:
    """The scheme of ``url``; a plain path is "file"."""
    scheme = urlsplit(url).scheme
    return "file" if len(scheme) <= 1 else scheme  # "C:" is a drive, not a scheme


def local_path(url: str) -> Path:
    parts = urlsplit(url)
    return Path(unquote(parts.path)) if parts.scheme == "file" else Path(url)


def is_folder(url: str) -> bool:
    return url.endswith("/") or (kind(url) == "file" and local_path(url).is_dir())


def check_url(url: str) -> None:
    """BadInput, one line, for a URL no source can be made of: an unknown scheme, no host, a port out of range."""
    scheme = kind(url)
    if scheme not in OWN_SCHEMES and not fsspec_knows(scheme):
        raise BadInput(
            f"{url}: fetch reads http(s)://, s3://, sftp://, paths and the URLs fsspec knows, not {scheme}://"
        )
    if scheme in ("http", "https", "sftp") and not urlsplit(url).hostname:
        raise BadInput(f"{url}: names no host")
    if scheme in ("http", "https", "sftp"):
        try:
            host_port(url)
        except TransferError as exc:
            raise BadInput(str(exc)) from None
        if urlsplit(url).port == 0:
            raise BadInput(f"{url}: the port is not a number from 1 to 65535")


def check_local_source(url: str) -> None:
    """BadInput for a path that is there and is not a regular file or a folder (a FIFO, a device)."""
    path = local_path(url)
    if not path.is_dir():
        refuse_non_regular(path, "source")


def check_dest(dest: Path) -> None:
    """BadInput for a DEST that is there and is neither a folder nor a regular file: a symlink to a file is
    neither followed nor replaced, a device or a FIFO never replaced (``--overwrite`` or not)."""
    try:
        found = os.lstat(dest)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BadInput(f"{dest}: {exc.strerror or exc}") from None
    if not (dest.is_dir() or (why := refusal(dest, found.st_mode)) is None):
        raise BadInput(why)


def safe_relative(name: str, url: str) -> PurePosixPath:
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise TransferError(f"{url}: the listing names {name!r}, which would land outside the destination")
    return relative


def plan_items(session: Session, sources: list[str], dest: Path, sha256: str | None = None) -> list[Item]:
    """The files to fetch, each with its destination path."""
    into_folder = len(sources) > 1 or any(map(is_folder, sources)) or dest.is_dir() or str(dest).endswith(os.sep)
    if sha256 and (into_folder or len(sources) != 1):
        raise BadInput("--checksum names the hash of one file: give one source file and a file destination")
    if into_folder and dest.exists() and not dest.is_dir():
        raise BadInput(f"{dest}: not a directory (several files, or a folder, go into a directory)")
    check_dest(dest)
    for url in sources:
        check_url(url)
        if kind(url) == "file":
            check_local_source(url)
    items = []
    for url in sources:
        if is_folder(url):
            listed = session.listing(url)
            if not listed:
                raise BadInput(f"{url}: holds no files")
            items += [Item(session.source(u), dest / safe_relative(name, url)) for u, name in listed]
        elif into_folder:
            name = PurePosixPath(urlsplit(url).path).name if kind(url) != "file" else local_path(url).name
            if not name:
                raise BadInput(f"{url}: names no file")
            items.append(Item(session.source(url), dest / name))
        else:
            items.append(Item(session.source(url), dest, sha256))
    seen: dict[Path, str] = {}
    for item in items:
        if item.dest in seen:
            raise BadInput(f"{seen[item.dest]} and {item.source.url} would both land at {item.dest}")
        seen[item.dest] = item.source.url
    return items
