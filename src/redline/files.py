"""Files a user names, or another user controls, opened the way a careful tool opens them.

A path on a shared server may name something other than a file: a FIFO (whose ``open`` blocks until a writer
comes, so a plain read hangs), a device (``/dev/zero`` reads without end), a folder, or a symlink planted by
someone else. Every file redline reads whole goes through ``open_regular``: it opens without blocking
(``O_NONBLOCK``: a FIFO opens at once), looks at what it opened (``fstat`` of the descriptor, not of the path,
so nothing can be swapped in between) and refuses anything but a regular file, in one line, before reading a
byte. A size cap keeps a huge file from being read into memory.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from redline.errors import BadInput
from redline.units import MiB, fmt_bytes

TEXT_LIMIT_BYTES = 16 * MiB  # a plan, a config, a manifest: far under this; a larger one is not what was meant


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO", "a folder"...), for a refusal."""
    for test, words in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return words
    return "a regular file" if stat.S_ISREG(mode) else "not a file"


def open_regular(
    path: str | os.PathLike[str],
    what: str,
    *,
    follow: bool = True,
    limit_bytes: int | None = None,
    owner: int | None = None,
) -> int:
    """A read-only descriptor of the regular file at ``path``; BadInput (one line, naming ``what`` and the
    path) when it is missing, unreadable, not a regular file, over ``limit_bytes``, or not owned by ``owner``
    (a uid, where given). ``follow=False``: a symlink as the last component is refused (``O_NOFOLLOW``)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise BadInput(f"no such {what}: {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise BadInput(f"{what} {path} is a symlink: it is not followed here") from None
        raise BadInput(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise BadInput(f"{what} {path} is {kind_of(found.st_mode)}, not a file")
        if owner is not None and found.st_uid != owner:
            raise BadInput(f"{what} {path} belongs to uid {found.st_uid}, not to uid {owner}")
        if limit_bytes is not None and found.st_size > limit_bytes:
            raise BadInput(f"{what} {path} is {fmt_bytes(found.st_size)}: over the {fmt_bytes(limit_bytes)} one may be")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_bytes(
    path: str | os.PathLike[str],
    what: str,
    *,
    limit_bytes: int = TEXT_LIMIT_BYTES,
    follow: bool = True,
    owner: int | None = None,
) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit_bytes`` (a file that grows past the cap
    while read is refused too); the refusals of ``open_regular``."""
    fd = open_regular(path, what, follow=follow, limit_bytes=limit_bytes, owner=owner)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit_bytes + 1)
    except OSError as exc:
        raise BadInput(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit_bytes:
        raise BadInput(f"{what} {path} is over the {fmt_bytes(limit_bytes)} one may be")
    return data


def read_user_file(path: str | os.PathLike[str], what: str, *, limit_bytes: int = TEXT_LIMIT_BYTES) -> str:
    """The UTF-8 text of a file the user named (``what`` says which kind, for the message); BadInput, one
    line, when it is missing, unreadable, not a regular file, too large, or not text."""
    data = read_user_bytes(path, what, limit_bytes=limit_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"cannot read {what} {path}: it is not UTF-8 text") from None


def refuse_non_regular(path: str | os.PathLike[str], what: str) -> None:
    """For a file about to be written or read: BadInput when ``path`` exists and is not a regular file (a FIFO
    would block the open, a device would swallow or yield without end, a folder cannot be one). A symlink is
    judged by what it points to."""
    try:
        found = os.stat(Path(path))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BadInput(f"cannot use {what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(found.st_mode):
        raise BadInput(f"{what} {path} is {kind_of(found.st_mode)}, not a file")
