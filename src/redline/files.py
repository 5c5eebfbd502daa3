"""Files a user names, or another user controls, opened the way a careful tool opens them.

A path on a shared server may name something other than a file: a FIFO (whose ``open`` blocks until a writer
comes, so a plain read hangs), a device (``/dev/zero`` reads without end), a folder, or a symlink planted by
someone else. Every file redline reads whole goes through ``open_regular``: it opens without blocking
(``O_NONBLOCK``: a FIFO opens at once), looks at what it opened (``fstat`` of the descriptor, not of the path,
so nothing can be swapped in between) and refuses anything but a regular file, in one line, before reading a
byte. A size cap keeps a huge file from being read into memory.

A folder whose files run as code when loaded (a checkpoint, an inference artifact) is first checked as OpenSSH
checks a user's keys (``check_trusted``): nobody but this user and root may have been able to write it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a disk, or the user's quota on it, is full (ENOSPC, EDQUOT): a write retried at
    once would only meet it again."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


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
    _refuse_unless(path, what, stat.S_ISREG, "a file")


def refuse_non_folder(path: str | os.PathLike[str], what: str) -> None:
    """For a folder about to be made or used: BadInput when ``path`` exists and is not a folder (a file, a
    FIFO, a device). A symlink is judged by what it points to."""
    _refuse_unless(path, what, stat.S_ISDIR, "a folder")


def _refuse_unless(path: str | os.PathLike[str], what: str, wanted: Callable[[int], bool], noun: str) -> None:
    """BadInput when ``path`` exists and its kind is not ``wanted`` (``noun`` names what it should be)."""
    try:
        found = os.stat(Path(path))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BadInput(f"cannot use {what} {path}: {exc.strerror or exc}") from None
    if not wanted(found.st_mode):
        raise BadInput(f"{what} {path} is {kind_of(found.st_mode)}, not {noun}")


def open_append(path: str | os.PathLike[str], what: str) -> int:
    """A descriptor that appends to the regular file at ``path`` (made if missing); BadInput, one line, when
    it is a FIFO, a device or a folder. Opened without blocking (a FIFO with a reader would otherwise take
    the writes, one without would block the open) and judged by ``fstat`` of what was opened."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO no one reads
            raise BadInput(f"{what} {path} is a FIFO, not a file") from None
        raise BadInput(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        os.close(fd)
        raise BadInput(f"{what} {path} is {kind_of(found.st_mode)}, not a file")
    os.set_blocking(fd, True)
    return fd


# --------------------------------------------------------------------------------------- trusted folders
#
# A checkpoint (PyTorch's sharded metadata is a pickle) and an inference artifact (a compiled model, a factory
# module) run code when loaded. As OpenSSH's StrictModes does for a user's keys, such a folder is used only
# when no one but this user and root could have written what it holds, or swapped it for another:
#
# - the folder and everything under it (what a symlink in it points to too) belong to this user or root, and
#   none of it is writable by its group or by everyone;
# - every folder a name on the way to it is looked up in (those above it, and those holding a symlink the path
#   crosses) belongs to this user or root, and is not writable by its group or by everyone unless it has the
#   sticky bit (/tmp: others may add entries there, but not rename or remove ours);
# - every symlink the path crosses belongs to this user or root (its owner may remove it and point it
#   elsewhere, in a sticky folder too).
#
# The check resolves the path itself, one name at a time as the kernel does, and hands back the folder it
# resolved to: the caller loads from that alone. Loading from the path as given would look it up again, and a
# symlink on it could point elsewhere by then.

MAX_SYMLINKS = 40  # the kernel's own limit on the links one lookup follows (ELOOP past it)


@dataclass(frozen=True)
class Trusted:
    """What ``check_trusted`` found no one else could have written: ``path``, the one asked about resolved (no
    symlink left on it), and ``identity``, the (st_dev, st_ino) of what it named when checked."""

    path: Path
    identity: tuple[int, int]

    def confirm(self, what: str) -> Path:
        """``path`` again, just before it is loaded; BadInput when it no longer names what was checked (this
        user or root replaced it since: no one else could)."""
        try:
            found = os.lstat(self.path)
        except OSError as exc:
            raise BadInput(f"{what} {self.path} is gone since it was checked: {exc.strerror or exc}") from None
        if (found.st_dev, found.st_ino) != self.identity:
            raise BadInput(f"{what} {self.path} was replaced since it was checked: load it again")
        return self.path


class _Lookup(NamedTuple):
    """A path resolved name by name: where it led, the lstat there, the folders names were looked up in, and
    the symlinks crossed (each with its lstat)."""

    real: Path
    found: os.stat_result
    folders: list[Path]
    links: list[tuple[Path, os.stat_result]]


def check_trusted(path: str | os.PathLike[str], what: str) -> Trusted | None:
    """Refuse (BadInput, one line naming the path and the fix) ``what`` at ``path`` when a user other than this
    one or root could have written it or swapped it (the rules above). None when nothing is there: nothing to
    load, and nothing may be loaded from ``path`` later either (what is made there afterwards was never
    checked). Else the ``Trusted`` folder: load from its ``path`` alone, ``confirm``ed just before."""
    lookup = _resolve(Path(path))
    if lookup is None:
        return None
    refusal = _lookup_problem(lookup) or _untrusted(lookup.real, set(), lookup.real)
    if refusal is not None:
        raise BadInput(f"refusing {what} {path}: {refusal}")
    return Trusted(lookup.real, (lookup.found.st_dev, lookup.found.st_ino))


def drop_write_for_others(folder: str | os.PathLike[str]) -> None:
    """No write permission for the group or everyone on ``folder`` and what it holds (a umask of 002 leaves
    them), so that what this user just saved passes ``check_trusted``. A file of another user (written by a
    rank on another node) is theirs to set: left as it is."""
    root = Path(folder)
    for path in _entries(root):
        with contextlib.suppress(OSError):
            mode = path.lstat().st_mode
            if mode & 0o022 and not stat.S_ISLNK(mode):
                path.chmod(stat.S_IMODE(mode) & ~0o022)


def _untrusted(real: Path, seen: set[Path], top: Path) -> str | None:
    """Why ``real`` (a resolved path: ``top``, the one asked about, or what a symlink under it points to) or
    what it holds is not to be trusted, or None (the folders on the way to it are ``_lookup_problem``'s)."""
    seen.add(real)
    for entry in _entries(real):
        found = _lstat(entry)
        if stat.S_ISLNK(found.st_mode):
            why = _link_problem(entry, seen, top)
        else:
            why = _entry_problem(entry, found, real, top)
        if why is not None:
            return why
    return None


def _link_problem(link: Path, seen: set[Path], top: Path) -> str | None:
    """Why what the symlink ``link`` (inside a folder being checked) leads to is not to be trusted, or None."""
    lookup = _resolve(link)
    if lookup is None:  # whoever may make the missing name would choose what loads through it
        return f"{link} points to {_readlink(link)}, which is not there: remove the link, or make what it names"
    why = _lookup_problem(lookup)
    if why is None and lookup.real not in seen:
        why = _untrusted(lookup.real, seen, top)
    return why


def _resolve(path: Path) -> _Lookup | None:
    """``path`` resolved as the kernel resolves it, one name at a time, noting each folder a name is looked up
    in and each symlink crossed; None where a name on the way is missing (or a file stands where a folder
    should). BadInput when it cannot be read, or crosses more than ``MAX_SYMLINKS`` links."""
    names = _names(path if path.is_absolute() else Path(os.getcwd(), path))
    current, found = Path("/"), _lstat(Path("/"))
    folders: list[Path] = []
    links: list[tuple[Path, os.stat_result]] = []
    while names:
        name = names.pop(0)
        if not stat.S_ISDIR(found.st_mode):
            return None  # ENOTDIR: a file cannot hold the rest
        if name == "..":
            current = current.parent
            found = _lstat(current)
            continue
        folders.append(current)
        entry = current / name
        try:
            found = os.lstat(entry)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise BadInput(f"cannot check {entry}: {exc.strerror or exc}") from None
        if not stat.S_ISLNK(found.st_mode):
            current = entry
            continue
        links.append((entry, found))
        if len(links) > MAX_SYMLINKS:
            raise BadInput(f"cannot check {path}: over {MAX_SYMLINKS} symlinks on the way to it (a loop?)")
        target = _readlink(entry)
        names[:0] = _names(Path(target))
        if target.startswith("/"):
            current, found = Path("/"), _lstat(Path("/"))
        else:
            found = _lstat(current)
    return _Lookup(current, found, folders, links)


def _readlink(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError as exc:
        raise BadInput(f"cannot check {link}: {exc.strerror or exc}") from None


def _names(path: Path) -> list[str]:
    """The names of ``path`` in order, ``..`` kept (the kernel takes it after what precedes it is resolved)."""
    return [name for name in str(path).split("/") if name not in ("", ".")]


def _lookup_problem(lookup: _Lookup) -> str | None:
    """Why the way to ``lookup.real`` could be changed by someone else, or None: a folder on it that fails the
    parent rule, or a symlink on it of another user's."""
    for folder in dict.fromkeys(lookup.folders):
        why = _parent_problem(
            folder, "the folder above it" if folder in lookup.real.parents else "a folder on the way to it"
        )
        if why is not None:
            return why
    for link, found in lookup.links:
        if not _trusted_owner(found.st_uid):
            return (
                f"{link}, a symlink on the way to it, belongs to {_user(found.st_uid)}, who could point it "
                f"elsewhere once it is checked: name {lookup.real} instead"
            )
    return None


def _entries(root: Path) -> list[Path]:
    """``root`` and everything under it, symlinks as themselves (not walked into: they are judged apart)."""
    if not root.is_dir():
        return [root]
    found = [root]
    for folder, folders, files in os.walk(root, followlinks=False):
        found += [Path(folder, name) for name in (*folders, *files)]
    return found


def _lstat(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except OSError as exc:
        raise BadInput(f"cannot check {path}: {exc.strerror or exc}") from None


def _entry_problem(entry: Path, found: os.stat_result, root: Path, top: Path) -> str | None:
    where = "it" if entry == top else str(entry)
    if not _trusted_owner(found.st_uid):
        return (
            f"{where} belongs to {_user(found.st_uid)}, not to you or root, and it runs as code here: "
            "copy what you trust into a folder of your own"
        )
    if found.st_mode & 0o022:
        return (
            f"{where} is writable by {_writers(found.st_mode)} (mode {found.st_mode & 0o7777:04o}), and it runs "
            f"as code here: chmod -R go-w {root}"
        )
    return None


def _parent_problem(parent: Path, role: str) -> str | None:
    """Why someone else could swap what ``parent`` holds (``role`` says where it stands), or None."""
    found = _lstat(parent)
    if not _trusted_owner(found.st_uid):
        return (
            f"{role}, {parent}, belongs to {_user(found.st_uid)}, who could swap it for another: "
            "keep it under folders that belong to you or root"
        )
    if found.st_mode & 0o022 and not found.st_mode & stat.S_ISVTX:
        return (
            f"{role}, {parent}, is writable by {_writers(found.st_mode)} without the sticky bit "
            f"(mode {found.st_mode & 0o7777:04o}), so anyone could swap it for another: chmod go-w {parent}"
        )
    return None


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _writers(mode: int) -> str:
    return {0o020: "its group", 0o002: "everyone"}.get(mode & 0o022, "its group and everyone")


def _user(uid: int) -> str:
    """``uid`` as ``name (uid N)``, or ``uid N`` where it has no name here."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
