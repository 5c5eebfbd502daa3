"""Reading remote shards through the local cache: the shard being read is on local disk, the next ones are
being fetched meanwhile, so a training loop waits on the network only for the first.

    staged = Staged([f"https://host/train-{i:05d}.tar" for i in range(1024)], ahead=2)
    for sample in staged.samples():   # webdataset's layout: {"__key__": "000017", "jpg": b"...", "cls": b"3"}
        ...
    for path in staged: ...           # or the local paths of any files, in order

From a DataLoader, wrap it in an ``IterableDataset`` whose ``__iter__`` iterates it: each DataLoader worker
and each rank reads its own share of the shards (shard i goes to reader i mod (ranks x workers), reader
rank x workers + worker, as webdataset splits by node and worker). Under ``redline.prepare`` pass
``shard_stream=False``, since the stream shares itself out. torch is never imported here: a DataLoader worker
has it loaded already, and the share is read from the loaded modules.

Each pass starts the fetch of the shard it needs and of the ``ahead`` after it, each in a thread of its
own (the cache's fills resume, verify and fetch each URL once across processes); each shard stays pinned in
the cache while it is read, and so does each shard fetched ahead, so no eviction removes them. The cache must
hold ``ahead + 1`` shards per reader. A shard that cannot be fetched raises ``StageError`` naming its URL
when the reader reaches it.
"""

from __future__ import annotations

import sys
import tarfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from redline.errors import BadInput, RedlineError, one_line
from redline.transfer.cache import Cache, Pinned, StageError


@dataclass(frozen=True)
class Member:
    """One file of a tar shard."""

    url: str  # the shard's
    name: str
    data: bytes


class Staged:
    """The files at ``urls``, in order, read through ``cache`` (a ``Cache``, its folder, or None for the
    default) with the next ``ahead`` fetched while one is read. ``split``: share the shards out over the
    DataLoader's workers and the ranks (``rank``/``world``: the data-parallel ones; default
    ``torch.distributed``'s where it is initialised, else one)."""

    def __init__(
        self,
        urls: Iterable[str],
        cache: Cache | str | Path | None = None,
        *,
        ahead: int = 2,
        split: bool = True,
        rank: int | None = None,
        world: int | None = None,
    ) -> None:
        self.urls = [str(url) for url in urls]
        if not self.urls:
            raise BadInput("no shards to stage")
        if not 0 <= ahead <= 1024:
            raise BadInput(f"ahead must be between 0 and 1024 shards, not {ahead}")
        if (rank is None) != (world is None) or (rank is not None and world is not None and not 0 <= rank < world):
            raise BadInput("give rank and world together, with 0 <= rank < world")
        self.cache = cache if isinstance(cache, Cache) else Cache(cache)
        self.ahead, self.split, self.rank, self.world = ahead, split, rank, world

    def __len__(self) -> int:
        return len(self.urls)

    def share(self) -> list[str]:
        """The shards this reader (this rank, this DataLoader worker) reads, in order."""
        if not self.split:
            return list(self.urls)
        reader, readers = _reader(self.rank, self.world)
        return self.urls[reader::readers]

    def __iter__(self) -> Iterator[Path]:
        """The local path of each shard of the share; valid until the next one is asked for."""
        for _, path in self.files():
            yield path

    def files(self) -> Iterator[tuple[str, Path]]:
        """(URL, local path) of each shard of the share, each pinned until the next one is asked for."""
        ahead = _Ahead(self.cache, self.share(), self.ahead)
        try:
            for index in range(len(ahead.urls)):
                pinned = ahead.take(index)
                try:
                    yield pinned.url, pinned.path
                finally:
                    pinned.close()
        finally:
            ahead.close()

    def members(self) -> Iterator[Member]:
        """Every file of every tar shard of the share, in archive order, streamed (tarfile's "r|*": any
        compression, no seeking back)."""
        for url, path in self.files():
            try:
                with path.open("rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
                    for info in tar:
                        # a regular member's file object; None for a folder, a link, a device
                        extracted = tar.extractfile(info) if info.isfile() else None
                        if extracted is not None:
                            yield Member(url, info.name, extracted.read())
            except tarfile.TarError as exc:
                raise StageError(f"{url}: not a tar archive it can read ({exc})") from None

    def samples(self) -> Iterator[dict]:
        """webdataset's samples: consecutive members sharing a key (the name up to the first dot of its
        last part) form one dict, ``{"__key__": key, "__url__": shard, extension: bytes, ...}``."""
        sample: dict | None = None
        for member in self.members():
            key, extension = split_name(member.name)
            if sample is not None and (sample["__key__"] != key or sample["__url__"] != member.url):
                yield sample
                sample = None
            if sample is None:
                sample = {"__key__": key, "__url__": member.url}
            sample[extension] = member.data
        if sample is not None:
            yield sample


def split_name(name: str) -> tuple[str, str]:
    """ "train/000017.seg.png" -> ("train/000017", "seg.png"), as webdataset keys its samples."""
    folder, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension


def _reader(rank: int | None, world: int | None) -> tuple[int, int]:
    """(this reader's index, readers in all): rank x workers + worker, of world x workers."""
    worker, workers = 0, 1
    data = sys.modules.get("torch.utils.data")
    if data is not None:
        info = data.get_worker_info()
        if info is not None:
            worker, workers = info.id, info.num_workers
    if rank is None or world is None:
        rank, world = 0, 1
        distributed = sys.modules.get("torch.distributed")
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            rank, world = distributed.get_rank(), distributed.get_world_size()
    return rank * workers + worker, world * workers


@dataclass
class _Slot:
    done: threading.Event = field(default_factory=threading.Event)
    pinned: Pinned | None = None
    error: BaseException | None = None


class _Ahead:
    """One pass's fetches: shard i and the ``ahead`` after it are staged, each in a daemon thread (a reader
    that stops mid-pass leaves no thread the interpreter waits on at exit; a fill cut there resumes later)."""

    def __init__(self, cache: Cache, urls: list[str], ahead: int) -> None:
        self.cache, self.urls, self.ahead = cache, urls, ahead
        self.slots: list[_Slot] = []
        self.closed = False
        self._lock = threading.Lock()

    def take(self, index: int) -> Pinned:
        """Shard ``index``, pinned, once staged; starts the fetches up to ``ahead`` past it first."""
        while len(self.slots) < min(len(self.urls), index + 1 + self.ahead):
            slot = _Slot()
            self.slots.append(slot)
            url = self.urls[len(self.slots) - 1]
            threading.Thread(target=self._stage, args=(url, slot), name="redline-stage", daemon=True).start()
        slot = self.slots[index]
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        pinned, slot.pinned = slot.pinned, None
        if pinned is None:  # staged without an error: only a second take of it, or one after close(), finds none
            raise RuntimeError(f"{self.urls[index]}: taken twice, or after the pass was closed")
        return pinned

    def _stage(self, url: str, slot: _Slot) -> None:
        try:
            pinned = self.cache.get(url)
        except RedlineError as exc:
            slot.error = exc
        except Exception as exc:  # a reader must learn which shard failed, whatever the failure
            slot.error = StageError(f"cannot stage {url}: {one_line(exc)}")
        else:
            with self._lock:
                if self.closed:
                    pinned.close()
                else:
                    slot.pinned = pinned
        finally:
            slot.done.set()

    def close(self) -> None:
        """Unpin what was staged ahead and not read; fetches still running unpin when they end."""
        with self._lock:
            self.closed = True
            for slot in self.slots:
                if slot.pinned is not None:
                    slot.pinned.close()
                    slot.pinned = None
