"""What the fetch and push engines share: their options, what they report per file and in all, the progress
they tell, and the retry of a failure a retry may cure (a reset, a read timeout, a 503) after a jittered,
doubling pause ("full jitter": many streams cut by one outage do not come back in step); a failure a retry
cannot cure (404, denied, the file changed) is a TransferError at once."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from redline.errors import one_line
from redline.transfer.limits import check_chunk, check_count, check_retries
from redline.transfer.link import DEFAULT_PER_ENDPOINT, Link
from redline.transfer.source import Remote, Source, TransferError

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0

_T = TypeVar("_T")  # what an attempt returns


@dataclass
class Options:
    streams: int | None = None  # chunks in flight at once; None: what the link needs
    per_endpoint: int = DEFAULT_PER_ENDPOINT
    chunk_bytes: int | None = None  # None: max(8 MiB, 2 x BDP)
    retries: int = 10  # per chunk, for failures a retry may fix
    overwrite: bool = False  # replace a destination that exists and differs from the remote file
    copy_links: bool = False  # a folder's symlinks: followed (True), or skipped with a notice (rclone's -L)

    def __post_init__(self) -> None:
        """Each count checked as the command line checks it, in its words (BadInput, one line)."""
        check_count("--streams", self.streams)
        check_count("--per-endpoint", self.per_endpoint)
        check_chunk(self.chunk_bytes)
        check_retries(self.retries)


@dataclass
class Item:
    """One file to fetch: where from, where to, and its SHA-256 when the user knows it."""

    source: Source
    dest: Path
    sha256: str | None = None
    remote: Remote | None = None  # what a stat of ``source`` said moments ago, when the caller made one


@dataclass
class FileResult:
    url: str
    dest: str
    size: int | None = None
    status: str = "pending"  # fetched, present (already there, the same file), failed
    moved_bytes: int = 0  # bytes this run received for it, retried ones included
    resumed_bytes: int = 0  # bytes an earlier run had fetched and this one kept
    retries: int = 0
    sha256: str | None = None
    verified_against: str | None = None  # "the store's checksum", "--checksum"; None: no reference known
    note: str | None = None  # why an earlier run's state was dropped
    error: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Progress:
    """What the engine tells whoever draws progress; this base draws nothing."""

    def add_total(self, size: int) -> None: ...
    def advance(self, size: int) -> None: ...  # negative when a failed chunk's bytes are fetched again
    def active(self, streams: int) -> None: ...
    def finished(self, result: FileResult) -> None: ...
    def note(self, message: str) -> None: ...  # something the user should hear of once (a wait on another process)


@dataclass
class Summary:
    files: list[FileResult]
    seconds: float
    streams: int
    chunk_bytes: int
    link: Link
    congestion: str | None
    skipped: list[str] = field(default_factory=list)  # a folder's entries not moved (symlinks...), each said

    @property
    def moved_bytes(self) -> int:
        return sum(f.moved_bytes for f in self.files)

    @property
    def bits_per_s(self) -> float:
        return self.moved_bytes * 8 / self.seconds if self.seconds > 0 else 0.0

    @property
    def failed(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "failed"]

    def to_dict(self) -> dict:
        return {
            "files": [f.to_dict() for f in self.files],
            "seconds": self.seconds,
            "moved_bytes": self.moved_bytes,
            "mbit_s": self.bits_per_s / 1e6,
            "streams": self.streams,
            "chunk_bytes": self.chunk_bytes,
            "link": self.link.__dict__ | {"described": self.link.describe()},
            "congestion_control": self.congestion,
            "skipped": self.skipped,
        }


# the clients' errors a retry may cure, by module: an exception of a client's class exists only once its module
# is imported, so the check looks only at those already loaded (an HTTP fetch never pays for importing paramiko)
_CLIENT_ERRORS = {
    "urllib3.exceptions": ("HTTPError",),
    "paramiko": ("SSHException",),
    "botocore.exceptions": ("BotoCoreError", "ClientError"),
}


def retryable(exc: BaseException) -> bool:
    """Whether a retry may cure ``exc``: the network's errors and those of the clients that speak over it."""
    if isinstance(exc, (OSError, EOFError)):
        return True
    for module, names in _CLIENT_ERRORS.items():
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(exc, tuple(getattr(loaded, name) for name in names)):
            return True
    return False


def retrying(attempt: Callable[[], _T], retries: int, result: FileResult, abandoned: Callable[[], bool]) -> _T:
    """``attempt()``, tried again after failures a retry may cure, at most ``retries`` times, after a pause drawn
    at random up to a doubling ceiling; TransferError, naming the last failure, when the tries run out."""
    for tries in range(retries + 1):
        try:
            return attempt()
        except TransferError:
            raise
        except Exception as exc:
            if not retryable(exc):
                raise
            if tries == retries or abandoned():
                raise TransferError(
                    f"{result.url}: gave up after {tries + 1} tries: {one_line(exc, typed=False)}"
                ) from None
            result.retries += 1
            time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**tries)))
    raise AssertionError("unreachable")
