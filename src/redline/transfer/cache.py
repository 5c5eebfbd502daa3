"""A size-capped cache of remote files on local disk (NVMe, ideally), shared by every job on the machine:
``redline stage`` and the ``Staged`` reader fill it, training reads from it.

One entry per source URL, named by a hash of the URL, in ``ROOT/entries/``: ``KEY.data`` (the file),
``KEY.json`` (url, size, state, added, last use) and two lock files. Entries are filled through
``redline.transfer.fetch``, so a fill cut by a kill resumes from its journal and is verified before it lands.

Locks (``flock``, released by the kernel when their holder dies, so a kill -9 leaves nothing held):

- ``KEY.pin``, shared: the entry is in use (being read, or being filled); eviction takes it exclusive and
  without waiting, so it never removes a file someone holds.
- ``KEY.fill``, exclusive: one filler per URL; a second process staging the same URL waits on it, then
  finds the entry ready (fetched once).
- ``ROOT/cache.lock``, exclusive and brief: admission (the sizes of all entries, the evictions that make
  room, the new entry's reservation) is one decision at a time across processes.

A lock file removed by an evictor while another process opened it would leave that process holding a lock
on a dead inode; so a lock is kept only when its path still names the inode locked (as ``redline.lockfile``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redline.errors import BadInput
from redline.transfer.source import Remote, TransferError
from redline.units import fmt_bytes

if TYPE_CHECKING:
    from redline.transfer.engine import Options, Progress
    from redline.transfer.link import Link
    from redline.transfer.session import Session
    from redline.transfer.source import Sockets

# no cap given: the cache may take this share of the space its disk has for it (free + what it holds)
DEFAULT_SHARE_OF_DISK = 0.8
META_VERSION = 1
STAT_TRIES = 3  # a blip of the network is worth a second try; a refused connection is not worth ten


class StageError(TransferError):
    """A file could not be staged: its fetch failed, or every byte of the cap is held by readers."""


class NotStageable(BadInput):
    """The URL names nothing the cache can hold: no such file, a folder, a file larger than the whole cache."""


@dataclass
class Entry:
    url: str
    key: str
    size_bytes: int
    state: str  # "ready"; "filling" while a fetch runs or after one was cut (it resumes on the next use)
    added: float  # seconds since the epoch
    last_used: float
    sha256: str | None = None
    path: str = ""
    in_use: bool | None = None  # a reader or filler holds it; None where not looked at

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Added:
    """What ``Cache.add`` did with one URL: its entry, whether this call fetched it (else it was there), and
    whether the cache still holds it once every URL was staged (a later one may have evicted it)."""

    entry: Entry
    fetched: bool
    kept: bool

    def to_dict(self) -> dict:
        return self.entry.to_dict() | {"fetched": self.fetched, "kept": self.kept}


class Pinned:
    """A ready entry held for reading: no eviction removes it until ``close()``."""

    def __init__(self, entry: Entry, fd: int, fetched: bool) -> None:
        self.entry, self.url, self.path = entry, entry.url, Path(entry.path)
        self.size_bytes = entry.size_bytes
        self.fetched = fetched  # this call fetched it; False: it was in the cache already
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a reader that forgot close(): its pin goes with it
        self.close()


def key_of(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:32]


def normalized(url: str) -> str:
    """The URL as the cache names it: a local path made absolute, so ``a.tar`` and ``./a.tar`` are one entry."""
    from redline.transfer.fs import local_path
    from redline.transfer.schemes import is_local

    if not url.strip():
        raise BadInput("an empty URL")
    if is_local(url):
        return str(local_path(url).absolute())
    return url


def default_root() -> Path:
    """The stage cache's folder where none is given: the data home's (``redline.env.state_dir``)."""
    from redline.env import State, state_dir

    return state_dir(State.STAGE)


class Cache:
    """``Cache(root, max_bytes)``; ``get(url)`` gives a ``Pinned`` entry, fetched first when absent.

    ``max_bytes`` given is saved with the cache (``ROOT/cache.json``), so every process using it keeps the
    same cap; never given, the cache takes at most ``DEFAULT_SHARE_OF_DISK`` of the disk space it could have.
    ``fetch_options`` (``transfer.Options``) and the keywords of ``transfer.fetch`` (``endpoint_url``,
    ``known_hosts``, ``key_file``) pass through to each fill."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        max_bytes: int | None = None,
        fetch_options: Options | None = None,
        **fetch_kw: Any,
    ) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.entries_dir = self.root / "entries"
        if self.root.exists() and not self.root.is_dir():
            raise BadInput(f"cache {self.root}: not a directory")
        try:
            self.entries_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"cannot make the cache {self.root}: {exc.strerror or exc}") from None
        self.fetch_options, self.fetch_kw = fetch_options, fetch_kw
        if max_bytes is not None:
            if max_bytes <= 0:
                raise BadInput("the cache's maximum size must be positive")
            with self._admission():
                _write_json(self.root / "cache.json", {"max_bytes": max_bytes})
                self._make_room(self.entries(), max_bytes)  # a lowered cap holds from now on
        self._state_lock = threading.Lock()
        self._session: Session | None = None
        self._links: dict[str, Link] = {}

    # pickled into DataLoader workers (spawn): the connections and measured links stay behind
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_state_lock", "_session", "_links")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._state_lock, self._session, self._links = threading.Lock(), None, {}

    # ------------------------------------------------------------------------------------------- reading

    def get(self, url: str, progress: Progress | None = None) -> Pinned:
        """The entry of ``url``, pinned; fetched now when the cache lacks it (a process filling it already:
        this one waits for it and fetches nothing)."""
        url = normalized(url)
        key = key_of(url)
        while True:
            pin = _lock(self._file(key, ".pin"), fcntl.LOCK_SH)
            try:
                entry = self._ready(key)
                fetched = False
                if entry is None:
                    fill = _lock(self._file(key, ".fill"), fcntl.LOCK_EX)
                    try:
                        entry = self._ready(key)  # another process may have filled it while this one waited
                        if entry is None:
                            entry, fetched = self._fill(url, key, progress), True
                    finally:
                        os.close(fill)
            except BaseException:
                os.close(pin)
                raise
            if entry is not None:
                entry.last_used = time.time()
                _write_json(self._file(key, ".json"), _meta(entry))
                return Pinned(entry, pin, fetched)
            os.close(pin)  # evicted between two looks: start again

    def add(self, urls: list[str], progress: Progress | None = None, *, allow_evict: bool = False) -> list[Added]:
        """Stage each of ``urls`` now (a URL named twice, once), as ``redline stage add`` does. What is asked
        must fit under the cap together, or nothing is fetched (NotStageable names the sizes and the cap):
        staging a file only to evict it for the next is a waste nobody asked for. With ``allow_evict`` each is
        fetched in turn, the later ones evicting the earlier where the cap needs it, and each says whether it
        was kept."""
        asked = list(dict.fromkeys(normalized(url) for url in urls))
        if not allow_evict and len(asked) > 1:  # one file is admitted (or refused) against the cap as it fills
            self._check_room(asked)
        done = []
        for url in asked:
            with self.get(url, progress) as pinned:
                done.append((pinned.entry, pinned.fetched))
        return [Added(entry, fetched, self._ready(entry.key) is not None) for entry, fetched in done]

    def _check_room(self, urls: list[str]) -> None:
        """Refuse, before any fetch, files that together are more than the cache holds (those already in it
        count at their size: they must stay too). A file another process is filling counts at the size it was
        admitted with: asking its server again would wait on the same stalled link the filler waits on."""
        cap = self.max_bytes()
        sizes = []
        for url in urls:
            entry = self._ready(key_of(url)) or self._filling(key_of(url))
            size = entry.size_bytes if entry is not None else self._stat(url)[1]
            if size > cap:
                raise NotStageable(self._larger_than_the_cache(url, size, cap))
            sizes.append(size)
        if sum(sizes) > cap:
            raise NotStageable(
                f"the {len(urls)} files asked are {fmt_bytes(sum(sizes))} in all and the cache holds "
                f"{fmt_bytes(cap)} ({self.root}): nothing was fetched; raise --max-size to "
                f"{fmt_bytes(sum(sizes))} or more, stage fewer, or give --allow-evict (each later file may then "
                "evict an earlier one)"
            )

    def _larger_than_the_cache(self, url: str, size: int, cap: int) -> str:
        whole = f"({fmt_bytes(cap)} at {self.root})"
        return f"{url}: {fmt_bytes(size)} is more than the whole cache holds {whole}; raise --max-size"

    def _filling(self, key: str) -> Entry | None:
        entry = self._entry(key)
        return entry if entry is not None and entry.state == "filling" else None

    def _ready(self, key: str) -> Entry | None:
        entry = self._entry(key)
        if entry is None or entry.state != "ready":
            return None
        try:
            if os.stat(entry.path).st_size != entry.size_bytes:
                return None
        except FileNotFoundError:
            return None
        return entry

    # ------------------------------------------------------------------------------------------- filling

    def _fill(self, url: str, key: str, progress: Progress | None) -> Entry:
        """Fetch ``url`` into the entry (this process holds its pin and its fill lock)."""
        from redline import transfer

        remote, size = self._stat(url)  # the fetch below takes it rather than asking again: a round trip less
        now = time.time()
        entry = Entry(url, key, size, "filling", now, now, path=str(self._file(key, ".data")))
        self._admit(entry)
        # overwrite: a data file the cache has no record of (its record lost) is replaced, never refused
        options = dataclasses.replace(self.fetch_options or transfer.Options(), overwrite=True)
        summary = transfer.fetch(
            [url], Path(entry.path), options, sockets=self._sockets(), link=self._link(url), progress=progress,
            remote=remote, **self.fetch_kw,
        )  # fmt: skip
        result = summary.files[0]
        if result.status == "failed":
            raise StageError(f"cannot stage {_naming(url, result.error)}")
        entry.state, entry.size_bytes, entry.sha256 = "ready", result.size or 0, result.sha256
        entry.last_used = time.time()
        _write_json(self._file(key, ".json"), _meta(entry))
        return entry

    def _stat(self, url: str) -> tuple[Remote, int]:
        """What the file at ``url`` is (its validators), and its size, which a fill needs known (room is made
        first); a source that is not there (404, no such file) is the user's to fix (NotStageable), a network that
        fails three tries may mend (StageError)."""
        from redline.transfer.engine import retryable
        from redline.transfer.session import is_folder

        if is_folder(url):
            raise NotStageable(f"{url}: a folder; the cache holds files: name each one")
        for tries in range(STAT_TRIES):
            try:
                remote = self._session_for().source(url).stat()
                if remote.size is None:
                    raise TransferError(f"{url}: the server gives no length, and the cache makes room before a fill")
                return remote, remote.size
            except TransferError as exc:
                raise NotStageable(f"cannot stage {_naming(url, str(exc))}") from None
            except Exception as exc:
                if not retryable(exc):
                    raise
                if tries == STAT_TRIES - 1:
                    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
                    raise StageError(f"cannot stage {_naming(url, reason)}") from None
                time.sleep(0.5 * 2**tries)
        raise AssertionError("unreachable")

    def _admit(self, entry: Entry) -> None:
        """Make room for ``entry`` (least recently used entries nobody holds go first) and reserve it."""
        with self._admission():
            cap = self.max_bytes()
            if entry.size_bytes > cap:
                raise NotStageable(self._larger_than_the_cache(entry.url, entry.size_bytes, cap))
            used = self._make_room([e for e in self.entries() if e.key != entry.key], cap - entry.size_bytes)
            if used + entry.size_bytes > cap:
                raise StageError(
                    f"cannot stage {entry.url} ({fmt_bytes(entry.size_bytes)}): {fmt_bytes(used)} of the cache's "
                    f"{fmt_bytes(cap)} is held by readers; raise --max-size or read fewer shards ahead"
                )
            free = shutil.disk_usage(self.root).free + _allocated(Path(entry.path + ".redline-part"))
            if free < entry.size_bytes:
                raise StageError(
                    f"cannot stage {entry.url} ({fmt_bytes(entry.size_bytes)}): the disk holding {self.root} has "
                    f"{fmt_bytes(free)} free"
                )
            _write_json(self._file(entry.key, ".json"), _meta(entry))

    def _make_room(self, entries: list[Entry], room_bytes: int) -> int:
        """Evict the least recently used of ``entries`` that nobody holds until they total ``room_bytes`` at
        most (under the admission lock); returns what they total then."""
        used = sum(e.size_bytes for e in entries)
        for victim in sorted(entries, key=lambda e: (e.last_used, e.added)):
            if used <= room_bytes:
                break
            if self._remove(victim.key):
                used -= victim.size_bytes
        return used

    # ------------------------------------------------------------------------------------------ the list

    def entries(self, look_in_use: bool = False) -> list[Entry]:
        """Every entry, least recently used first; ``look_in_use`` says which ones are held now."""
        found = []
        for meta in self.entries_dir.glob("*.json"):
            entry = self._entry(meta.name.removesuffix(".json"))
            if entry is not None:
                if look_in_use:
                    entry.in_use = self._in_use(entry.key)
                found.append(entry)
        return sorted(found, key=lambda e: (e.last_used, e.added))

    def max_bytes(self) -> int:
        """The cap saved with the cache, else DEFAULT_SHARE_OF_DISK of the free space plus what it holds."""
        saved = _read_json(self.root / "cache.json")
        if saved and isinstance(saved.get("max_bytes"), int) and saved["max_bytes"] > 0:
            return saved["max_bytes"]
        held = sum(e.size_bytes for e in self.entries())
        return int(DEFAULT_SHARE_OF_DISK * (shutil.disk_usage(self.root).free + held))

    def cap_is_set(self) -> bool:
        return bool(_read_json(self.root / "cache.json"))

    def evict(self, url: str) -> str:
        """Remove the entry of ``url``: "evicted", "absent", or "in use" (a reader holds it: kept)."""
        key = key_of(normalized(url))
        with self._admission():
            if self._entry(key) is None:
                return "absent"
            return "evicted" if self._remove(key) else "in use"

    def clear(self) -> tuple[list[Entry], list[Entry]]:
        """Remove every entry nobody holds: (removed, kept because in use). Lock files of URLs that were
        never staged (their source was missing) go too."""
        removed: list[Entry] = []
        kept: list[Entry] = []
        with self._admission():
            for entry in self.entries():
                (removed if self._remove(entry.key) else kept).append(entry)
            listed = {entry.key for entry in kept}
            for key in {path.name.split(".")[0] for path in self.entries_dir.iterdir()} - listed:
                self._remove(key)
        return removed, kept

    # ---------------------------------------------------------------------------------------------- parts

    def _file(self, key: str, suffix: str) -> Path:
        return self.entries_dir / f"{key}{suffix}"

    def _entry(self, key: str) -> Entry | None:
        meta = _read_json(self._file(key, ".json"))
        if not meta or meta.get("version") != META_VERSION:
            return None
        try:
            return Entry(
                str(meta["url"]), key, int(meta["size_bytes"]), str(meta["state"]), float(meta["added"]),
                float(meta["last_used"]), meta.get("sha256"), str(self._file(key, ".data")),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None

    def _remove(self, key: str) -> bool:
        """Delete an entry's files unless someone holds it; False when held."""
        pin = _flock(self._file(key, ".pin"), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if pin is None:
            return False
        try:
            for path in self.entries_dir.glob(f"{key}.*"):
                if path.suffix != ".pin":
                    path.unlink(missing_ok=True)
            self._file(key, ".pin").unlink(missing_ok=True)  # last, while held: see the module's docstring
        finally:
            os.close(pin)
        return True

    def _in_use(self, key: str) -> bool:
        try:
            fd = os.open(self._file(key, ".pin"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    @contextlib.contextmanager
    def _admission(self) -> Iterator[None]:
        fd = _lock(self.root / "cache.lock", fcntl.LOCK_EX)
        try:
            yield
        finally:
            os.close(fd)

    def _session_for(self) -> Session:
        from redline import transfer

        with self._state_lock:
            if self._session is None:
                options = self.fetch_options or transfer.Options()
                kw = self.fetch_kw
                credentials = transfer.Credentials(kw.get("endpoint_url"), kw.get("known_hosts"), kw.get("key_file"))
                self._session = transfer.Session(self._sockets(), options.per_endpoint, credentials)
            return self._session

    def _sockets(self) -> Sockets:
        from redline import transfer

        return transfer.sockets_for("bbr")

    def _link(self, url: str) -> Link:
        """What is known of the link to ``url``'s endpoint, measured once per cache object."""
        from redline.transfer.link import to_endpoint

        endpoint = self._session_for().source(url).endpoint
        with self._state_lock:
            link = self._links.get(endpoint)
        if link is None:
            link = to_endpoint(endpoint, "down")
            with self._state_lock:
                self._links[endpoint] = link
        return link

    def close(self) -> None:
        with self._state_lock:
            if self._session is not None:
                self._session.close()
                self._session = None


def _lock(path: Path, mode: int) -> int:
    """A descriptor holding ``flock(mode)`` on ``path`` (made if absent), waited for while another holds it:
    ``mode`` without LOCK_NB (``_flock`` tries one that may find it held)."""
    fd = _flock(path, mode)
    if fd is None:
        raise ValueError(f"{path}: a lock taken with LOCK_NB may be refused; try it with _flock")
    return fd


def _flock(path: Path, mode: int) -> int | None:
    """A descriptor holding ``flock(mode)`` on ``path`` (made if absent); None when ``mode`` has LOCK_NB and
    another holds it. Kept only when the path still names the inode locked (an evictor may have removed it)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            named = os.stat(path)
        except FileNotFoundError:
            named = None
        own = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (own.st_dev, own.st_ino):
            return fd
        os.close(fd)


def _naming(url: str, message: str | None) -> str:
    """``message`` with the URL in front, unless it names it already (most transfer errors do)."""
    message = message or "failed"
    return message if url in message else f"{url}: {message}"


def _meta(entry: Entry) -> dict:
    return {"version": META_VERSION, **{k: v for k, v in entry.to_dict().items() if k not in ("path", "in_use")}}


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a reader never sees half a record (written aside, then renamed over)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    temporary.write_text(json.dumps(data), encoding="utf-8")
    os.replace(temporary, path)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _allocated(path: Path) -> int:
    """Bytes a part file already takes on disk (a resumed fill needs only the rest)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
