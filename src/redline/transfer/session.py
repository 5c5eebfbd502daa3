"""From the URLs a user typed to the files to move: which kind of endpoint each is (its record in ``schemes``),
what a folder or prefix holds, and where each file lands.

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
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Protocol, TypeVar, cast
from urllib.parse import urlsplit

from redline.errors import BadInput
from redline.files import refuse_non_regular
from redline.transfer.engine import Item
from redline.transfer.fs import local_path
from redline.transfer.http import host_port
from redline.transfer.landing import refusal
from redline.transfer.schemes import is_local, lookup
from redline.transfer.source import Credentials, Sockets, Source, TransferError


class Closable(Protocol):
    """Connections a session holds: a pool, a client."""

    def close(self) -> None: ...


Shared = TypeVar("Shared", bound=Closable)


class Session:
    """The connections a transfer shares (HTTP pools, SSH connections, an S3 client...), each made on first use
    by the scheme that needs it (``shared``) and all closed by ``close()``; and the entries of the folders listed
    that are not moved."""

    def __init__(
        self,
        sockets: Sockets,
        per_endpoint: int,
        credentials: Credentials | None = None,
        copy_links: bool = False,
    ) -> None:
        self.sockets, self.per_endpoint, self.copy_links = sockets, per_endpoint, copy_links
        self.credentials = credentials or Credentials()
        self.skipped: list[str] = []  # entries of the folders listed that are not moved, each with why
        self._shared: dict[str, Closable] = {}
        self._lock = threading.Lock()  # a cache's session opens sources from several fills at once

    def shared(self, key: str, make: Callable[[], Shared]) -> Shared:
        """The connections ``key`` names (a scheme's pool, its client), made by ``make`` on first use."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = make()
            return cast(Shared, self._shared[key])  # what ``make`` gave for this key

    def source(self, url: str) -> Source:
        check_url(url)
        return lookup(url).source(self, url)

    def listing(self, url: str) -> list[tuple[str, str]]:
        """The files below a folder URL: (URL, path below it)."""
        return lookup(url).listing(self, url)

    def close(self) -> None:
        with self._lock:
            shared, self._shared = list(self._shared.values()), {}
        for connections in shared:
            connections.close()


def is_folder(url: str) -> bool:
    return url.endswith("/") or (is_local(url) and local_path(url).is_dir())


def check_url(url: str) -> None:
    """BadInput, one line, for a URL no source can be made of: an unknown scheme, no host, a port out of range."""
    if not lookup(url).host:
        return
    if not urlsplit(url).hostname:
        raise BadInput(f"{url}: names no host")
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


def plan_items(session: Session, sources: list[str], dest: Path | str, sha256: str | None = None) -> list[Item]:
    """The files to fetch, each with its destination path. ``dest`` ending in a slash is a folder, made if it
    is missing (a ``Path`` would drop the slash: `fetch FILE data/` must not write a file called ``data``)."""
    named_folder = str(dest).endswith(("/", os.sep))
    dest = Path(dest)
    into_folder = len(sources) > 1 or any(map(is_folder, sources)) or dest.is_dir() or named_folder
    if sha256 and (into_folder or len(sources) != 1):
        raise BadInput("--checksum names the hash of one file: give one source file and a file destination")
    if into_folder and dest.exists() and not dest.is_dir():
        raise BadInput(f"{dest}: not a directory (several files, or a folder, go into a directory)")
    check_dest(dest)
    for url in sources:
        check_url(url)
        if lookup(url).local:
            check_local_source(url)
    items = []
    for url in sources:
        if is_folder(url):
            listed = session.listing(url)
            if not listed:
                raise BadInput(f"{url}: holds no files")
            items += [Item(session.source(u), dest / safe_relative(name, url)) for u, name in listed]
        elif into_folder:
            name = local_path(url).name if lookup(url).local else PurePosixPath(urlsplit(url).path).name
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
