"""The user's DataLoader, spread over the ranks without changing what it loads.

The loader is rebuilt once, because a DataLoader cannot change its sampler or batch size after it is made;
every other setting it has is carried over as it is (``KEPT``). What changes:

- a map-style dataset's sampler, whatever it is (sequential, random, weighted, a user's own), is wrapped in
  ``DistributedView``: every rank draws the sampler's order for the epoch alike and takes every world-th index
  of it, so the ranks together see exactly what one process would have seen, in the same order, and a
  ``WeightedRandomSampler`` keeps its weights;
- an ``IterableDataset`` is read through ``RankShard``: every (ranks x workers)-th item, so each rank and each
  of its DataLoader workers reads a disjoint share;
- the batch size becomes the per-rank batch; the epoch's short last global batch is kept or dropped as the
  loader's ``drop_last`` says: kept, it is split over the ranks like the others, and each rank's ``BatchShare``
  weighs its loss by its samples, so the step is still the mean over that batch's samples (a rank that holds
  none of them loads one and weighs it 0: every rank takes part in the step's collectives);
- a batch sampler of the user's own (batches by length or token budget) is wrapped in ``DistributedBatches``:
  each batch it draws stays one global batch, split over the ranks; torch's plain ``BatchSampler`` is its
  sampler and batch size, and goes the first way.

All three resume mid-epoch without loading again what a checkpoint already trained on. The order is drawn from
one seed per run, the same on every rank (``fixed_seed`` names the one the user fixed; ``feed.py`` decides it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import signal
import threading
from collections.abc import Iterable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from redline.errors import BadInput, RedlineError
from redline.hw.host_state import process_state

log = logging.getLogger("redline.runtime")

# the DataLoader settings carried over from the user's loader as they are (the constructor's own names)
KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)

SEEDS = 2**64  # torch's seeds are unsigned 64-bit: a seed plus an epoch wraps around


@dataclasses.dataclass(frozen=True)
class BatchShare:
    """This rank's part of one global batch, which its loss is weighed by: the loop's micro-batches and their
    loss divisors (``feed.micro_batches``) read it."""

    loaded: int
    """Samples in this rank's batch as the loader gives it."""
    trained: int
    """Of them, the samples this rank trains on: all of them, except that a rank holding none of a short last
    batch loads one of another rank's (it must take part in the step's collectives) and trains on none."""
    global_samples: int
    """Samples of the global batch, over all the ranks."""
    world: int
    """The ranks the global batch is split over (whose gradients are averaged)."""
    fewest: int
    """The fewest samples any rank loads for this batch: every rank splits it in as many micro-batches."""
    uneven: bool = False
    """Its micro-batches may differ in size by one (a batch sampler's batches, the short last batch)."""

    @classmethod
    def whole(cls, per_rank: int, world: int) -> BatchShare:
        """A global batch of ``per_rank`` samples on each of ``world`` ranks."""
        return cls(per_rank, per_rank, per_rank * world, world, per_rank)

    @classmethod
    def last(cls, samples: int, *, world: int, rank: int) -> BatchShare:
        """The epoch's short last global batch of ``samples``, split as ``DistributedView`` splits it: rank
        ``r`` holds its samples ``r, r + world, ...``."""
        held = [len(range(r, samples, world)) for r in range(world)]
        return cls(max(1, held[rank]), held[rank], samples, world, max(1, min(held)), uneven=True)

    def loss_divisor(self, micro_samples: int) -> float:
        """What the mean loss of a micro-batch of ``micro_samples`` of this share is divided by to make it its
        part of the global batch's mean loss, the ranks' gradients being averaged: the global batch's samples
        over (ranks x the micro-batch's). The accumulation where every rank holds a whole batch in equal parts;
        infinite (the loss counts 0) for a rank that trains on none of the batch."""
        if self.trained == 0:
            return math.inf
        return self.global_samples / (self.world * micro_samples)


class DistributedView(Sampler[int]):
    """This rank's share of any sampler: of the order the sampler draws for an epoch, the indices at
    ``rank, rank + world, ...``, starting ``skip`` in (a run resumed mid-epoch). Taken ``per_rank_batch`` at a
    time, rank ``r``'s batch ``k`` is the samples ``r, r + world, ...`` of global batch ``k`` of the order.

    With ``drop_last`` the order is cut to whole global batches, so every rank has as many whole batches.
    Without, the short last global batch is split over the ranks too, and a rank that holds none of it (a batch
    smaller than the ranks) gets its first sample, which ``share`` weighs 0: every rank has as many batches (a
    BatchNorm synchronised over the ranks counts that sample twice in that one batch's statistics).

    Every rank must draw the same order. A sampler that draws from a ``generator`` (RandomSampler,
    WeightedRandomSampler, SubsetRandomSampler) is given one seeded with ``seed + epoch`` for the draw, ``seed``
    the run's data seed (the same on every rank: ``feed.py``): the same order on every rank, and again after a
    restart. A sampler with ``set_epoch`` gets the epoch. Any other sampler must be deterministic by itself;
    ``fingerprint`` lets the ranks check that it is.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        *,
        world: int,
        rank: int,
        seed: int,
        per_rank_batch: int = 1,
        drop_last: bool = True,
    ) -> None:
        self.sampler = sampler
        self.world = world
        self.rank = rank
        self.seed = seed
        self.per_rank_batch = per_rank_batch
        self.drop_last = drop_last
        self.skip = 0
        self.samples = 0  # of the epoch's order, those the ranks train on
        self._order: list[int] = []
        self._fingerprint = 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw the epoch's order now, in the main process, before any worker starts."""
        order = [int(i) for i in _draw(self.sampler, self.seed, epoch)]
        self._fingerprint = hash(tuple(order))
        global_batch = self.world * self.per_rank_batch
        self.samples = len(order) // global_batch * global_batch if self.drop_last else len(order)
        self._order = order[self.rank : self.samples : self.world]
        short = self.samples % global_batch
        if short and self.rank >= short:  # none of the short last batch is this rank's: its first, weighed 0
            self._order.append(order[self.samples - short])

    def share(self, batch_index: int) -> BatchShare:
        """This rank's part of the epoch's global batch ``batch_index``."""
        global_batch = self.world * self.per_rank_batch
        if batch_index < self.samples // global_batch:
            return BatchShare.whole(self.per_rank_batch, self.world)
        return BatchShare.last(self.samples % global_batch, world=self.world, rank=self.rank)

    def fingerprint(self) -> int:
        """The epoch's whole order as one number (int hashes are the same in every process): ranks whose
        numbers differ drew different orders, and would train on overlapping shares."""
        return self._fingerprint

    def __iter__(self) -> Iterator[int]:
        return iter(self._order[self.skip :])

    def __len__(self) -> int:
        return max(0, len(self._order) - self.skip)


class DistributedBatches(Sampler[list[int]]):
    """This rank's share of a user's batch sampler (batches by length, by token budget), starting ``skip``
    batches in. ``per_rank`` (``loader_batch``, as under DDP): each batch the sampler draws is one rank's,
    ``world`` of them an optimizer step (rank ``r`` takes batches ``r, r + world, ...``; the last few that make
    no whole step are left out). Otherwise each batch is one global batch, whatever its size: the indices at
    ``rank, rank + world, ...``, the batch cut to a multiple of ``world`` (a batch smaller than ``world`` is left
    out). The epoch's order is drawn as ``DistributedView`` draws it; ``sizes`` are this rank's batch sizes in
    that order (the loader yields batches in order)."""

    def __init__(
        self, batch_sampler: Iterable[list[int]], *, world: int, rank: int, seed: int, per_rank: bool = False
    ) -> None:
        self.batch_sampler = batch_sampler
        self.world = world
        self.rank = rank
        self.seed = seed
        self.per_rank = per_rank
        self.skip = 0
        self._steps: list[list[int]] = []  # per optimizer step, every rank's batch size
        self._batches: list[list[int]] = []
        self._fingerprint = 0
        self.set_epoch(0)

    @property
    def sampler(self) -> Iterable[list[int]]:  # what the ranks' check names when they differ
        return self.batch_sampler

    def set_epoch(self, epoch: int) -> None:
        drawn = [[int(i) for i in batch] for batch in _draw(self.batch_sampler, self.seed, epoch)]
        self._fingerprint = hash(tuple(map(tuple, drawn)))
        world = self.world
        if self.per_rank:
            drawn = [batch for batch in drawn if batch]
            groups = [drawn[start : start + world] for start in range(0, len(drawn) // world * world, world)]
            self._batches = [group[self.rank] for group in groups]
        else:
            shares = [
                [batch[rank : len(batch) // world * world : world] for rank in range(world)]
                for batch in drawn
                if len(batch) >= world
            ]
            groups, self._batches = shares, [share[self.rank] for share in shares]
        self._steps = [[len(batch) for batch in group] for group in groups]

    @property
    def sizes(self) -> list[int]:
        """This rank's batch sizes, in the epoch's order."""
        return [sizes[self.rank] for sizes in self._steps]

    def share(self, batch_index: int) -> BatchShare:
        """This rank's part of the epoch's optimizer step ``batch_index``: its batch, weighed against every
        rank's (per-rank batches may differ in size)."""
        sizes = self._steps[batch_index]
        mine = sizes[self.rank]
        return BatchShare(mine, mine, sum(sizes), self.world, min(sizes), uneven=True)

    def fingerprint(self) -> int:
        return self._fingerprint

    def mean_batch(self) -> float:
        """The mean samples per optimizer step, over every rank, of the epoch drawn."""
        return sum(map(sum, self._steps)) / max(1, len(self._steps))

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches[self.skip :])

    def __len__(self) -> int:
        return max(0, len(self._batches) - self.skip)


def fixed_seed(loader: DataLoader, configured: int | None) -> int | None:
    """The seed the user fixed for the loader's order, if any: that of the generator its sampler draws from
    (``DataLoader(shuffle=True, generator=g)`` gives its RandomSampler ``g``; a DDP script's DistributedSampler
    has its ``seed``), else of the loader's own ``generator``, else ``configured`` (the run's ``data.seed``).
    None: nothing fixes it, and the run draws one from the process's seed, as a plain DataLoader does."""
    batches = loader.batch_sampler
    sampler: Any = loader.sampler  # batch_size=None: the items are batches (distributed_loader refuses it)
    if own_batch_sampler(loader) is not None:
        sampler = batches  # its generator, or that of the sampler it batches (_drawing)
    elif batches is not None:
        sampler = cast(BatchSampler, batches).sampler  # torch's BatchSampler batches its sampler's order
    if isinstance(sampler, DistributedSampler):
        return sampler.seed
    for generator in (getattr(_drawing(sampler), "generator", None), loader.generator):
        if isinstance(generator, torch.Generator):
            return generator.initial_seed()
    return configured


def _drawing(sampler: Any) -> Any:
    """The object whose ``generator`` draws the order: the sampler, or the sampler a batch sampler batches."""
    if not hasattr(sampler, "generator") and hasattr(getattr(sampler, "sampler", None), "generator"):
        return sampler.sampler
    return sampler


def _draw(sampler: Any, seed: int, epoch: int) -> list[Any]:
    """The sampler's order for the epoch, the same in every process: drawn with a generator seeded with
    ``seed + epoch`` where it draws from one (the user's generator is put back after), else after
    ``set_epoch``, else as it is (a deterministic sampler)."""
    source = _drawing(sampler)
    if hasattr(source, "generator"):
        saved = source.generator
        source.generator = torch.Generator().manual_seed((seed + epoch) % SEEDS)
        try:
            return list(sampler)
        finally:
            source.generator = saved
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return list(sampler)


class RankShard(IterableDataset):
    """This rank's share of an ``IterableDataset``: item ``k`` of the stream goes to the rank and worker with
    ``k % (world x workers) == rank x workers + share``. ``skip`` batches of this rank were already trained on
    (a resumed run): each share skips its part of them, as the DataLoader takes batches from its workers in
    turn (``in_order``, the default). The stream is read whole by every rank and worker, each keeping its
    share: fine for streams of shards or generated samples; a dataset that can seek should shard itself
    (Hugging Face's ``split_dataset_by_node``)."""

    def __init__(self, dataset: IterableDataset, *, world: int, rank: int, batch_size: int) -> None:
        self.dataset = dataset
        self.world = world
        self.rank = rank
        self.batch_size = batch_size
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        """The user's dataset's own attributes (a ``worker_init_fn`` reading ``get_worker_info().dataset``)."""
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # the loader takes its first batch from worker 0: after ``skip`` batches, worker 0 must carry on the
        # share whose turn it is
        share = (worker + self.skip) % workers
        mine = itertools.islice(iter(self.dataset), self.rank * workers + share, None, self.world * workers)
        done_batches = len(range(share, self.skip, workers))  # of the rank's batches, those of this share
        return itertools.islice(mine, done_batches * self.batch_size, None)


def distributed_loader(
    loader: DataLoader,
    *,
    world: int,
    rank: int,
    per_rank_batch: int,
    seed: int,
    overrides: dict[str, Any],
    shard_stream: bool = True,
    drop_last: bool | None = None,
    per_rank_batches: bool = False,
) -> DataLoader:
    """The user's loader for this rank: its settings (``overrides`` from the run's config win where not None),
    its sampler or stream shared out, the per-rank batch, its order drawn from ``seed``. Its short last batch
    is kept or dropped as its ``drop_last`` says (``drop_last`` set: as that says); a stream's is dropped (its
    length is unknown until it ends, when the ranks can no longer share it out). A generator of its own seeds
    the workers per epoch and rank (``set_position``): the user's is left as it is. ``shard_stream=False``
    leaves an IterableDataset that shards itself over the ranks as it is. A batch sampler of the user's own
    keeps its batches: each one rank's with ``per_rank_batches``, else each split over the ranks."""
    if loader.batch_size is None and loader.batch_sampler is None:
        raise BadInput("the DataLoader has batch_size=None (each item already a batch): give it a batch_size")
    settings = {name: getattr(loader, name) for name in KEPT if hasattr(loader, name)}
    settings |= {key: value for key, value in overrides.items() if value is not None}
    if settings["num_workers"] == 0:  # the constructor refuses these without workers
        settings.pop("prefetch_factor", None)
        settings.pop("multiprocessing_context", None)
        settings["persistent_workers"] = False
    elif settings.get("prefetch_factor") is None:
        settings["prefetch_factor"] = 2
    generator = torch.Generator()
    if isinstance(loader.dataset, IterableDataset):
        dataset = _stream_for_rank(loader.dataset, world=world, rank=rank, batch=per_rank_batch, shard=shard_stream)
        if isinstance(dataset, RankShard):
            # the shares and the resume arithmetic follow the loader's turn over its workers, and a persistent
            # worker would keep the epoch and skip it was started with
            _require(settings, "a stream shared over ranks and workers", persistent_workers=False, in_order=True)
        return DataLoader(dataset, batch_size=per_rank_batch, drop_last=True, generator=generator, **settings)
    own = own_batch_sampler(loader)
    if own is not None:
        _require(settings, "a batch sampler's batches (their sizes are looked up in order)", in_order=True)
        batches = DistributedBatches(own, world=world, rank=rank, seed=seed, per_rank=per_rank_batches)
        return DataLoader(loader.dataset, batch_sampler=batches, generator=generator, **settings)
    # batches of one size come from torch's BatchSampler: the one given, or the one the DataLoader made from
    # its batch_size and drop_last (loader_batch)
    plain = cast(BatchSampler, loader.batch_sampler)
    drop = plain.drop_last if drop_last is None else drop_last
    sampler = DistributedView(
        _undistributed(plain.sampler), world=world, rank=rank, seed=seed, per_rank_batch=per_rank_batch, drop_last=drop
    )
    return DataLoader(
        loader.dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=drop, generator=generator, **settings
    )


def loader_batch(loader: DataLoader) -> int | None:
    """The loader's batch: its ``batch_size``, or that of the torch ``BatchSampler`` it was given; None for a
    batch sampler of the user's own, whose batches may vary in size."""
    if loader.batch_size is not None:
        return loader.batch_size
    if type(loader.batch_sampler) is BatchSampler:
        return loader.batch_sampler.batch_size
    return None


def own_batch_sampler(loader: DataLoader) -> Iterable[list[int]] | None:
    """The batch sampler of the user's own the loader draws its batches from (``DistributedBatches`` shares it
    out); None where its batches are torch's ``BatchSampler``'s, all of one size."""
    return loader.batch_sampler if loader_batch(loader) is None else None


def batches_vary(loader: DataLoader) -> bool:
    """Whether the loader draws its batches from a batch sampler of the user's own (``DistributedBatches``)."""
    return own_batch_sampler(loader) is not None


def per_rank_batch(loader: DataLoader) -> int:
    """The batch of a loader ``distributed_loader`` made for batches of one size (a sampler's share, a stream's):
    its ``batch_size``, the per-rank batch. ValueError for one drawing a batch sampler's batches, which vary."""
    if loader.batch_size is None:
        raise ValueError("the loader draws a batch sampler's batches, of varying size: it has no one batch size")
    return loader.batch_size


def rank_view(loader: DataLoader) -> DistributedView | DistributedBatches | None:
    """What shares a prepared map-style loader out over the ranks (None for a stream)."""
    if isinstance(loader.batch_sampler, DistributedBatches):
        return loader.batch_sampler
    return loader.sampler if isinstance(loader.sampler, DistributedView) else None


def _require(settings: dict[str, Any], why: str, **wanted: Any) -> None:
    for name, value in wanted.items():
        if settings.get(name, value) != value:
            log.warning("%s=%s set to %s for %s", name, settings[name], value, why)
            settings[name] = value


def _stream_for_rank(dataset: IterableDataset, *, world: int, rank: int, batch: int, shard: bool) -> Any:
    """The stream read through ``RankShard``, unless it shards itself (``shard_stream=False``). A Hugging Face
    ``IterableDataset`` shards itself over DataLoader workers already: sharing it again would read a square of
    the workers' share."""
    if not shard:
        return dataset
    if hasattr(dataset, "n_shards") and hasattr(dataset, "_distributed"):  # datasets.IterableDataset
        raise BadInput(
            "a Hugging Face IterableDataset shards itself over DataLoader workers: split it over the ranks with "
            "datasets.distributed.split_dataset_by_node(dataset, rank, world_size) and pass shard_stream=False"
        )
    return RankShard(dataset, world=world, rank=rank, batch_size=batch)


def _undistributed(sampler: Iterable[int]) -> Iterable[int]:
    """A user's own DistributedSampler (from a DDP script) already takes one rank's share: the order it shares
    out is a plain one, which DistributedView shares out instead."""
    if not isinstance(sampler, DistributedSampler):
        return sampler
    log.info("the loader's DistributedSampler is replaced by the order it shares out; redline shares it over the ranks")
    dataset = cast(Sized, sampler.dataset)  # DistributedSampler took its len() when it was made
    if sampler.shuffle:
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(sampler.seed))
    return SequentialSampler(dataset)


def set_position(loader: DataLoader, *, epoch: int, batches_done: int, seed: int, rank: int) -> None:
    """Before iterating an epoch: the sampler's (or stream's) epoch and order seed, the batches to skip, and the
    workers' seed. The workers' seed is drawn from the loader's generator, seeded per epoch and rank from the
    run's seed: workers on different ranks must not draw the same augmentations, and a resumed run draws as the
    interrupted one did."""
    view = rank_view(loader)
    if view is not None:
        view.seed = seed
        view.set_epoch(epoch)
        view.skip = batches_done if isinstance(view, DistributedBatches) else batches_done * per_rank_batch(loader)
    elif isinstance(loader.dataset, RankShard):
        loader.dataset.set_epoch(epoch)
        loader.dataset.skip = batches_done
    else:  # a stream that shards itself: its epoch; it cannot be told where to resume
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        if batches_done and rank == 0:
            log.warning(
                "the stream shards itself: resumed at batch %d of the epoch, it starts the epoch again", batches_done
            )
    loader.generator.manual_seed((seed + 1_000_003 * epoch + rank) % SEEDS)


def batch_share(loader: DataLoader, batch_index: int, *, world: int) -> BatchShare:
    """This rank's part of the epoch's global batch ``batch_index``, for a loader ``distributed_loader`` made
    for ``world`` ranks: a batch sampler's batch is one rank's, weighed against the others' of the step, or
    split evenly (cut to a multiple of the ranks) under ``loader_batch="global"``; a sampler's
    last batch may be short (``DistributedView.share``); a stream's batches are whole."""
    view = rank_view(loader)
    if view is not None:
        return view.share(batch_index)
    return BatchShare.whole(per_rank_batch(loader), world)


class LoaderStalled(RedlineError):
    """A DataLoader worker gave no batch within the loader's timeout."""


def next_batch(batches: Iterator[Any], loader: DataLoader, *, stall_s: float = 0) -> Any:
    """The next batch, None at the end. A timeout (the user's, or the run's ``loader_stall_s``) ends the run
    with the worker that owes the batch, its pid and state, instead of DataLoader's bare "timed out". Without
    workers the Dataset runs in this process, and a timer (``stall_s``) interrupts it where it is stuck."""
    if loader.num_workers == 0 and stall_s > 0:
        with _stall_alarm(stall_s):
            return next(batches, None)
    try:
        return next(batches, None)
    except RuntimeError as exc:
        if "DataLoader timed out" not in str(exc):
            raise
        raise LoaderStalled(f"the DataLoader gave no batch for {loader.timeout:g} s: {_owing(batches)}") from None


@contextlib.contextmanager
def _stall_alarm(seconds: float) -> Iterator[None]:
    """SIGALRM after ``seconds`` raises LoaderStalled where the main thread is (a read, a lock, a sleep), naming
    the line. Only the main thread gets signals, and a SIGALRM handler of the user's own is left alone; a read
    the kernel cannot interrupt (a hard NFS mount) cannot be reached by any signal until it returns."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGALRM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def stalled(signum: int, frame: Any) -> None:
        raise LoaderStalled(
            f"the DataLoader gave no batch for {seconds:g} s: its Dataset (no workers: in this process) is stuck at "
            f"{_where(frame)} (a stuck read or a deadlock? set loader_stall_s to wait longer)"
        )

    signal.signal(signal.SIGALRM, stalled)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _where(frame: Any) -> str:
    """The innermost line outside torch and redline: the user's Dataset code the process was running."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    inner = frame
    while frame is not None:
        if not frame.f_code.co_filename.startswith(skip):
            break
        frame = frame.f_back
    frame = frame or inner
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _owing(batches: Any) -> str:
    """Which worker the loader was waiting for, from its iterator's bookkeeping (``_task_info``: batch index ->
    worker id, for batches asked of a worker and not yet received)."""
    try:
        worker_id = batches._task_info[batches._rcvd_idx][0]
        process = batches._workers[worker_id]
    except (AttributeError, KeyError, IndexError):
        state = None
    else:
        state = process_state(process.pid)
    if state is None:
        return "a worker hangs (set DataLoader(timeout=...) or loader_stall_s to wait longer)"
    return (
        f"worker {worker_id} (pid {process.pid}, {state}) owes batch {batches._rcvd_idx} of the epoch; "
        "a stuck read or a deadlock in the Dataset? (set DataLoader(timeout=...) or loader_stall_s to wait longer)"
    )
