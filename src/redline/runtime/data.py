"""The user's DataLoader, spread over the ranks without changing what it loads.

The loader is rebuilt once, because a DataLoader cannot change its sampler or batch size after it is made;
every other setting it has is carried over as it is (``KEPT``). What changes:

- a map-style dataset's sampler, whatever it is (sequential, random, weighted, a user's own), is wrapped in
  ``DistributedView``: every rank draws the sampler's order for the epoch alike and takes every world-th index
  of it, so the ranks together see exactly what one process would have seen, in the same order, and a
  ``WeightedRandomSampler`` keeps its weights;
- an ``IterableDataset`` is read through ``RankShard``: every (ranks x workers)-th item, so each rank and each
  of its DataLoader workers reads a disjoint share;
- the batch size becomes the per-rank batch, and a short last batch is dropped (every step takes the plan's
  global batch, so accumulation and the loss scaling stay exact, as in Megatron).

Both resume mid-epoch without loading again what a checkpoint already trained on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from redline.errors import BadInput, RedlineError

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


class DistributedView(Sampler[int]):
    """This rank's share of any sampler: of the order the sampler draws for an epoch, the indices at
    ``rank, rank + world, ...`` (cut to a multiple of ``world``, so every rank has as many), starting ``skip``
    in (a run resumed mid-epoch).

    Every rank must draw the same order. A sampler that draws from a ``generator`` (RandomSampler,
    WeightedRandomSampler, SubsetRandomSampler) is given one seeded with ``seed + epoch`` for the draw, where
    ``seed`` is the seed of the generator the user gave it, else the run's: the same order on every rank, and
    again after a restart. A sampler with ``set_epoch`` gets the epoch. Any other sampler must be deterministic
    by itself; ``fingerprint`` lets the ranks check that it is.
    """

    def __init__(self, sampler: Sampler[int], *, world: int, rank: int, seed: int) -> None:
        self.sampler = sampler
        self.world = world
        self.rank = rank
        own = getattr(sampler, "generator", None)
        self.seed = own.initial_seed() if isinstance(own, torch.Generator) else seed
        self.skip = 0
        self._order: list[int] = []
        self._fingerprint = 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw the epoch's order now, in the main process, before any worker starts."""
        if hasattr(self.sampler, "generator"):
            saved = self.sampler.generator
            self.sampler.generator = torch.Generator().manual_seed(self.seed + epoch)
            try:
                order = list(self.sampler)
            finally:
                self.sampler.generator = saved
        else:
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            order = list(self.sampler)
        order = [int(i) for i in order]
        self._fingerprint = hash(tuple(order))
        usable = len(order) // self.world * self.world
        self._order = order[self.rank : usable : self.world]

    def fingerprint(self) -> int:
        """The epoch's whole order as one number (int hashes are the same in every process): ranks whose
        numbers differ drew different orders, and would train on overlapping shares."""
        return self._fingerprint

    def __iter__(self) -> Iterator[int]:
        return iter(self._order[self.skip :])

    def __len__(self) -> int:
        return max(0, len(self._order) - self.skip)


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
) -> DataLoader:
    """The user's loader for this rank: its settings (``overrides`` from the run's config win where not None),
    its sampler or stream shared out, the per-rank batch. The loader's ``generator`` (or a new one) seeds the
    workers per epoch and rank (``set_position``). ``shard_stream=False`` leaves an IterableDataset that shards
    itself over the ranks as it is."""
    if loader.batch_size is None:
        if loader.batch_sampler is not None:
            raise BadInput(
                "the DataLoader has its own batch_sampler: redline sets the per-rank batch itself; give the loader "
                "batch_size and a sampler instead (batch_sampler support is not there yet)"
            )
        raise BadInput("the DataLoader has batch_size=None (each item already a batch): give it a batch_size")
    settings = {name: getattr(loader, name) for name in KEPT if hasattr(loader, name)}
    settings |= {key: value for key, value in overrides.items() if value is not None}
    if settings["num_workers"] == 0:  # the constructor refuses these without workers
        settings.pop("prefetch_factor", None)
        settings.pop("multiprocessing_context", None)
        settings["persistent_workers"] = False
    elif settings.get("prefetch_factor") is None:
        settings["prefetch_factor"] = 2
    generator = loader.generator if loader.generator is not None else torch.Generator()
    if isinstance(loader.dataset, IterableDataset):
        dataset = _stream_for_rank(loader.dataset, world=world, rank=rank, batch=per_rank_batch, shard=shard_stream)
        if isinstance(dataset, RankShard):
            # the shares and the resume arithmetic follow the loader's turn over its workers, and a persistent
            # worker would keep the epoch and skip it was started with
            for name, wanted in (("persistent_workers", False), ("in_order", True)):
                if settings.get(name, wanted) != wanted:
                    log.warning(
                        "%s=%s set to %s for a stream shared over ranks and workers", name, settings[name], wanted
                    )
                    settings[name] = wanted
        return DataLoader(dataset, batch_size=per_rank_batch, drop_last=True, generator=generator, **settings)
    sampler = DistributedView(_undistributed(loader.sampler), world=world, rank=rank, seed=seed)
    return DataLoader(
        loader.dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, generator=generator, **settings
    )


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


def _undistributed(sampler: Sampler[int]) -> Sampler[int]:
    """A user's own DistributedSampler (from a DDP script) already takes one rank's share: the order it shares
    out is a plain one, which DistributedView shares out instead."""
    if not isinstance(sampler, DistributedSampler):
        return sampler
    log.info("the loader's DistributedSampler is replaced by the order it shares out; redline shares it over the ranks")
    if sampler.shuffle:
        return RandomSampler(sampler.dataset, generator=torch.Generator().manual_seed(sampler.seed))
    return SequentialSampler(sampler.dataset)


def set_position(loader: DataLoader, *, epoch: int, batches_done: int, seed: int, rank: int) -> None:
    """Before iterating an epoch: the sampler's (or stream's) epoch, the batches to skip, and the workers' seed.
    The workers' seed is drawn from the loader's generator, seeded per epoch and rank: workers on different
    ranks must not draw the same augmentations, and a resumed run draws as the interrupted one did."""
    if isinstance(loader.sampler, DistributedView):
        loader.sampler.set_epoch(epoch)
        loader.sampler.skip = batches_done * loader.batch_size
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
    loader.generator.manual_seed(seed + 1_000_003 * epoch + rank)


class LoaderStalled(RedlineError):
    """A DataLoader worker gave no batch within the loader's timeout."""


def next_batch(batches: Iterator[Any], loader: DataLoader) -> Any:
    """The next batch, None at the end. A timeout (the user's, or the run's ``loader_stall_s``) ends the run
    with the worker that owes the batch, its pid and state, instead of DataLoader's bare "timed out"."""
    try:
        return next(batches, None)
    except RuntimeError as exc:
        if "DataLoader timed out" not in str(exc):
            raise
        raise LoaderStalled(f"the DataLoader gave no batch for {loader.timeout:g} s: {_owing(batches)}") from None


def _owing(batches: Any) -> str:
    """Which worker the loader was waiting for, from its iterator's bookkeeping (``_task_info``: batch index ->
    worker id, for batches asked of a worker and not yet received)."""
    import psutil

    try:
        worker_id = batches._task_info[batches._rcvd_idx][0]
        process = batches._workers[worker_id]
        state = psutil.Process(process.pid).status()
    except (AttributeError, KeyError, IndexError, psutil.Error):
        return "a worker hangs (set DataLoader(timeout=...) or loader_stall_s to wait longer)"
    return (
        f"worker {worker_id} (pid {process.pid}, {state}) owes batch {batches._rcvd_idx} of the epoch; "
        "a stuck read or a deadlock in the Dataset? (set DataLoader(timeout=...) or loader_stall_s to wait longer)"
    )
