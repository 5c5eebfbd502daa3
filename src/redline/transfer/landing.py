"""Where a fetched file lands: its folder, opened once, and every name beside the destination written inside
that folder without following a symlink.

A download's destination is often in a folder others can write to (a shared ``/data``, a sticky ``/tmp``).
Anyone there can plant ``DEST.redline-part`` or ``DEST.redline-journal`` as a symlink to a file of the user
running the fetch (root's ``/etc/...``): a plain ``open(part, "wb")`` would truncate that file, and the
journal's header would overwrite another. So every name is opened relative to the folder's descriptor
(``dir_fd``: the folder cannot be swapped for a link under a running fetch), with ``O_NOFOLLOW``; a file the
fetch makes is made with ``O_EXCL`` after whatever held its name is unlinked (a link is removed, never
followed); an earlier run's state is taken up only from regular files this user owns (another user's journal
and part file could carry any bytes with matching hashes) that have no other name (a hard link to a file of
this user's elsewhere would have the fetch write into it); and the final rename is a ``renameat`` inside the
folder. The destination itself must be a regular file, or nothing: a symlink, a device (``/dev/null``), a
FIFO or a folder there is refused, ``--overwrite`` or not.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from redline.files import kind_of
from redline.transfer.source import TransferError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_EXISTING = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO planted there opens, and is refused


class NoSpace(TransferError):
    """The destination's disk is full (ENOSPC, EDQUOT): a retry would only fill it again."""


def refusal(path: Path, mode: int) -> str | None:
    """Why a destination of ``mode`` (from an lstat) cannot be written, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return f"{path}: a symlink; fetch does not write through one, nor replace it (name its target)"
    return f"{path}: {kind_of(mode)}, not a regular file; fetch does not replace it"


class Landing:
    """The folder ``dest`` lands in, open; the destination's name and those of its part file and journal."""

    def __init__(self, dest: Path, part_name: str, journal_name: str) -> None:
        self.dest = dest
        self.name, self.part, self.journal = dest.name, part_name, journal_name
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.dir_fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        fd, self.dir_fd = self.dir_fd, -1  # -1 first: a late user fails (EBADF), never meets a reused number
        if fd >= 0:
            os.close(fd)

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def destination(self) -> os.stat_result | None:
        """What is at the destination now: None, or a regular file's stat; TransferError for anything else."""
        found = self.lstat(self.name)
        if found is not None and (why := refusal(self.dest, found.st_mode)):
            raise TransferError(why)
        return found

    def create(self, name: str) -> int:
        """A new, empty file at ``name`` for writing: whatever held the name is unlinked first (a planted
        symlink is removed, not followed), and the file is made with O_EXCL so none can be slipped in between."""
        try:
            os.unlink(name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise TransferError(f"{self.dest.parent / name}: a folder, where fetch keeps its state") from None
        return os.open(name, _NEW, 0o666, dir_fd=self.dir_fd)

    def open_own(self, name: str, flags: int) -> int | None:
        """``name`` opened with ``flags`` when it is a regular file of this user's with no other name, not
        through a symlink; None when it is missing or anything else (then it is not this fetch's to take up).
        A second name is another user's hard link to a file of this user's elsewhere (a folder they may write,
        protected_hardlinks off): writing there would write that file."""
        try:
            fd = os.open(name, flags | _EXISTING, dir_fd=self.dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # a link, a folder, a FIFO with no reader
                return None
            raise
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_nlink != 1:
            os.close(fd)
            return None
        os.set_blocking(fd, True)
        return fd

    def open_part(self) -> int:
        """The part file, for writing at offsets; TransferError when it is no longer this fetch's file."""
        fd = self.open_own(self.part, os.O_RDWR)
        if fd is None:
            raise TransferError(f"{self.dest.parent / self.part}: replaced by something else during the fetch")
        return fd

    def free_bytes(self) -> int:
        info = os.fstatvfs(self.dir_fd)
        return info.f_bavail * info.f_frsize

    def land(self, part_fd: int, mtime_s: float | None) -> None:
        """The part file, its data on disk and its mtime set, renamed over the destination inside the open
        folder (a rename never follows a link at either name), and the rename itself made durable."""
        os.fsync(part_fd)
        if mtime_s is not None:
            os.utime(part_fd, (mtime_s, mtime_s))
        self.destination()  # a symlink or a device put there since the fetch began is refused, not replaced
        os.rename(self.part, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        os.fsync(self.dir_fd)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.dir_fd)
