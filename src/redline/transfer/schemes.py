"""Every kind of endpoint a transfer reaches, one record each, as rclone's backends register with ``fs.Register``
and describe themselves with ``fs.Features``: callers look a URL's record up and read its traits, never its name.

A record says how to open a URL of its scheme as a source (``source``), list what a folder URL holds
(``listing``), open it as push's destination (``destination``; None where push does not send there), whether its
reads take any byte range (``ranges``: a file read over many streams), whether its URLs name a host (``host``)
and whether it is a path on this machine (``local``). What a scheme's logins take (an S3 endpoint, an SSH key) is
one object, the session's ``Credentials``; each scheme's opener reads its own fields of it, and makes the
connections its sources share through ``Session.shared``.

Adding a scheme is a module of its own (its ``Source``, its openers) and one record in ``SCHEMES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from redline.errors import BadInput
from redline.transfer import fs, http, s3, sftp

if TYPE_CHECKING:
    from redline.transfer.session import Session
    from redline.transfer.source import Source
    from redline.transfer.upload import Destination


class Ranges(Enum):
    """Whether a scheme's reads take any byte range, so the fetch may read one file over many streams: what the
    scheme promises before any file is asked; the fetch acts on what each file's stat found (``Remote.ranged``)."""

    ALWAYS = "always"
    # the stat asks (``Remote.ranged``): a server that ignores ranges sends the whole file, which one stream reads
    IF_SERVER_HONOURS = "if the server honours them"


@dataclass(frozen=True, eq=False)  # eq=False: a record is its own identity, hashable as a key
class Scheme:
    """One kind of endpoint and its traits."""

    names: tuple[str, ...]  # the URL schemes it serves ("http", "https"); a plain path is "file"
    display: str  # how the commands' messages name it: "http(s)://", "paths"
    source: Callable[[Session, str], Source]  # a URL of it as a source (one remote file)
    listing: Callable[[Session, str], list[tuple[str, str]]]  # a folder URL's files: (URL, path below it)
    ranges: Ranges
    destination: Callable[[Session, str], Destination] | None = None  # push's; None: push does not send there
    host: bool = False  # its URLs name a host, and a port from 1 to 65535 where they give one
    local: bool = False  # a path on this machine: no link to measure, a push to it is a fetch from the sources
    serves: Callable[[str], bool] | None = None  # scheme names it takes beyond ``names`` (fsspec's protocols)

    def claims(self, name: str) -> bool:
        return name in self.names or (self.serves is not None and self.serves(name))


HTTP = Scheme(
    names=("http", "https"),
    display="http(s)://",
    source=http.open_source,
    listing=http.no_listing,
    ranges=Ranges.IF_SERVER_HONOURS,
    host=True,
)
S3 = Scheme(
    names=("s3",),
    display="s3://",
    source=s3.open_source,
    listing=s3.open_listing,
    ranges=Ranges.ALWAYS,
    destination=s3.open_destination,
)
SFTP = Scheme(
    names=("sftp",),
    display="sftp://",
    source=sftp.open_source,
    listing=sftp.open_listing,
    ranges=Ranges.ALWAYS,
    destination=sftp.open_destination,
    host=True,
)
LOCAL = Scheme(
    names=("file",),
    display="paths",
    source=fs.open_local,
    listing=fs.local_listing,
    ranges=Ranges.ALWAYS,
    local=True,
)
FSSPEC = Scheme(
    names=(),
    display="the URLs fsspec knows",
    source=fs.open_fsspec,
    listing=fs.fsspec_listing,
    ranges=Ranges.ALWAYS,
    serves=fs.fsspec_knows,
)

# looked up in this order: fsspec, which has filesystems of the others' names too, comes last
SCHEMES: tuple[Scheme, ...] = (HTTP, S3, SFTP, LOCAL, FSSPEC)


def kind(url: str) -> str:
    """The scheme of ``url``; a plain path is "file"."""
    scheme = urlsplit(url).scheme
    return "file" if len(scheme) <= 1 else scheme  # "C:" is a drive, not a scheme


def find(url: str) -> Scheme | None:
    """The record that serves ``url``; None where none does."""
    name = kind(url)
    return next((scheme for scheme in SCHEMES if scheme.claims(name)), None)


def lookup(url: str) -> Scheme:
    """The record that serves ``url``; BadInput, one line naming what fetch reads, where none does."""
    scheme = find(url)
    if scheme is None:
        readable = listed([s.display for s in SCHEMES], "and")
        raise BadInput(f"{url}: fetch reads {readable}, not {kind(url)}://")
    return scheme


def is_local(url: str) -> bool:
    """Whether ``url`` is a path on this machine (a plain path or a file:// URL)."""
    scheme = find(url)
    return scheme is not None and scheme.local


def push_targets() -> str:
    """What push sends to, for its message: the schemes with a destination, or a path."""
    return listed([s.display for s in SCHEMES if s.destination is not None] + ["a path"], "or")


def listed(words: list[str], last: str) -> str:
    """``a, b and c``: the words in a sentence, the last joined by ``last``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"
