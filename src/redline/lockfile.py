"""One writer per file: an advisory lock held in a file beside it, released by the kernel when its holder dies.

``flock`` on ``<path>.lock``, never on the file itself: SQLite (the monitor record) keeps POSIX locks on its
database, and a second descriptor of that file, once closed, would silently drop them. The lock file holds the
holder's pid, so the second writer is told who holds it. A kill -9 of the holder frees the lock at once (the
kernel closes its descriptors); the stale file left behind is taken over by the next writer.

Removing the file on release races with a writer that opened it just before: that writer would lock an
unlinked inode while a third creates a new file. So a writer that got the lock checks that the path still names
the inode it locked, and starts again when not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from redline.errors import BadInput


class HeldElsewhere(BadInput):
    """Another process holds the lock; ``holder`` is its pid when the lock file says."""

    def __init__(self, message: str, holder: int | None) -> None:
        super().__init__(message)
        self.holder = holder


class WriterLock:
    """``WriterLock(path).acquire()`` or ``with WriterLock(path):``: exclusive, non-blocking, one per path."""

    def __init__(self, path: str | os.PathLike[str], what: str = "file") -> None:
        self.target = Path(path)
        self.path = self.target.with_name(self.target.name + ".lock")
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        while self._fd is None:
            try:
                # O_NOFOLLOW: a symlink planted at the lock's name (a shared folder) is refused, not written through
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise BadInput(
                    f"cannot write {self.what} {self.target}: creating its lock {self.path.name} failed "
                    f"({exc.strerror or exc}; check that the folder is writable)"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"another process (pid {holder})" if holder else "another process"
                raise HeldElsewhere(
                    f"{self.what} {self.target} is being written by {who}: it takes one writer; "
                    "use another path, or stop that one first",
                    holder,
                ) from None
            if _same_inode(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
            else:  # the holder before us removed the file as we opened it: lock the one at the path now
                os.close(fd)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still holding it: see the module's docstring
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def _same_inode(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
