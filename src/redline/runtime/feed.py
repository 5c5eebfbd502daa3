"""This rank's batches for the loop: the user's DataLoader shared out over the ranks (``data.py``), each batch
split into micro-batches (``batch.py``), and the ranks kept in step: they draw the order from one seed (rank
0's), once per epoch they check that they drew one order, and over a stream, per batch, that every rank still
has one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from redline.errors import BadInput
from redline.runtime.batch import bounds, split
from redline.runtime.config import RunConfig
from redline.runtime.data import (
    SEEDS,
    BatchShare,
    DistributedBatches,
    batch_share,
    distributed_loader,
    fixed_seed,
    loader_batch,
    next_batch,
    per_rank_batch,
    rank_view,
    set_position,
)
from redline.runtime.distributed import agree, same_on_every_rank

log = logging.getLogger("redline.runtime")

ADAPT_MIN_STEPS = 5  # an epoch of fewer steps says too little of how long its batches take
ADAPT_MIN_WAIT_S = 0.5  # an epoch that waited less in all gains less than starting workers costs
MAX_PREFETCH = 8  # batches per worker the loader may hold ahead, at most, when the runtime deepens it


def per_rank_batch_without_plan(data: DataLoader, setting: str, *, world: int) -> int:
    """Without a plan, the per-rank batch the loader's batch makes: the loader's batch itself (``per_rank``, as
    under DDP), or its share of it as the global batch (``global``: it must share evenly over the ranks). A
    batch sampler of the user's own sets the micro-batches from its batches (``Feed``): 1 stands for them."""
    if setting == "global" and world > 1 and isinstance(data.sampler, DistributedSampler):
        raise BadInput(
            "the loader has a DistributedSampler, so its batch is each rank's (DDP's convention), but "
            "loader_batch='global' makes it the global batch: drop the one that does not hold"
        )
    batch = loader_batch(data)
    if batch is None:
        if data.batch_sampler is None:
            raise BadInput("the DataLoader has batch_size=None: give it a batch size (each rank's, see loader_batch)")
        return 1
    if setting == "global" and batch % world:
        raise BadInput(
            f"loader_batch='global': the loader's batch of {batch} is the global batch, which {world} ranks "
            f"cannot share evenly: give the loader a multiple of {world}, or a plan"
        )
    return batch if setting == "per_rank" else batch // world


def micro_batches(batch: Any, *, parts: int, share: BatchShare) -> list[tuple[Any, float]]:
    """This rank's batch (``share.loaded`` samples) in ``parts`` micro-batches, each with the divisor that makes
    its loss its part of the global batch's mean (``BatchShare.loss_divisor``). Every rank splits a batch in as
    many micro-batches, each ending in a collective (the out-of-memory agreement, FSDP2's reduce-scatter): no
    more than the fewest samples a rank holds of it."""
    micros = split(batch, min(parts, share.fewest), share.loaded, uneven=share.uneven)
    edges = bounds(share.loaded, len(micros))
    return [(micro, share.loss_divisor(edges[index + 1] - edges[index])) for index, micro in enumerate(micros)]


def run_seed(loader: DataLoader, configured: int | None, *, device: torch.device) -> int:
    """The seed of the run's data order and workers, rank 0's on every rank: the one the user fixed
    (``data.fixed_seed``: a generator of the loader's or its sampler's, else ``data.seed``), else one drawn from
    the process's default generator as a DataLoader without a generator draws its order's, so that
    ``torch.manual_seed`` decides it. Every rank draws (its random stream moves on alike) and takes rank 0's:
    scripts seed each rank apart (nanoGPT's ``1337 + rank``) and the ranks must still share one order."""
    seed = fixed_seed(loader, configured)
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seed
    # a tensor-parallel group shares one batch, so every rank of the run takes rank 0's, not just the data ranks;
    # the tensor holds the unsigned seed as a signed one
    shared = torch.tensor([seed - SEEDS if seed >= SEEDS // 2 else seed], dtype=torch.int64, device=device)
    dist.broadcast(shared, src=0)
    return int(shared.item()) % SEEDS


class Feed:
    """The user's DataLoader for this rank: every setting kept (the config's loader settings win where set),
    its sampler or stream shared out over the ranks, the per-rank batch (``data.py``)."""

    def __init__(self, loader: DataLoader, config: RunConfig, *, world: int, rank: int, device: torch.device) -> None:
        self.world = world
        self.rank = rank
        self.device = device
        self.config = config
        self.iterable = isinstance(loader.dataset, IterableDataset)
        self.source = loader
        self.seed = run_seed(loader, config.data.seed, device=device)
        # a pipeline's schedule splits whole batches into its micro-batches: the short last one is dropped
        self.drop_last = True if config.strategy.pipeline > 1 else None
        self.loader = self._build(self._loader_settings(loader))
        self._said_slow = False  # the run said once why it leaves a slow loader as it is
        sampler = self.loader.batch_sampler
        self.batches = sampler if isinstance(sampler, DistributedBatches) else None  # batches of every size

    def say_batch(self, *, planned: bool) -> None:
        """Before the first step, what an optimizer step trains on, where the script may have meant another
        batch: on several ranks, how the loader's batch is read (``loader_batch``); a plan's batch that replaces
        the loader's; with the steps per epoch a scheduler's length follows from."""
        setting, world, strategy = self.config.data.loader_batch, self.world, self.config.strategy
        steps = "" if self.iterable else f", {len(self.loader)} optimizer steps per epoch"
        if self.batches is not None:  # a batch sampler's: kept whatever the plan says
            if world > 1:
                log.warning(
                    "the batch sampler's batches are kept, each %s (loader_batch=%r): %.1f samples per optimizer "
                    "step on average%s",
                    "one rank's" if setting == "per_rank" else "split over the ranks",
                    setting,
                    self.batches.mean_batch(),
                    steps,
                )
            return
        batch, mine = loader_batch(self.source), self.config.per_rank_batch
        if batch is None:  # a loader without a batch size is refused as the loader is made
            return
        meant = batch if setting == "per_rank" else batch // world
        split = f" (micro-batch {strategy.micro_batch} x accumulation {strategy.accumulation})"
        step = f"{mine} per rank x {world} rank(s) = {mine * world} per optimizer step"
        step += split if strategy.accumulation > 1 else ""
        if planned and meant != mine:
            log.warning(
                "the plan's batch replaces the loader's batch_size=%s (%s): %s%s; size schedulers with "
                "run.total_steps(epochs)",
                batch,
                "each rank's" if setting == "per_rank" else "the global batch",
                step,
                steps,
            )
        elif world > 1 and not planned:
            how = "each rank's, as under DDP" if setting == "per_rank" else "the global batch"
            log.warning("the loader's batch_size=%s is %s (loader_batch=%r): %s%s", batch, how, setting, step, steps)

    def _build(self, overrides: dict[str, Any]) -> DataLoader:
        return distributed_loader(
            self.source,
            world=self.world,
            rank=self.rank,
            per_rank_batch=self.config.per_rank_batch,
            seed=self.seed,
            shard_stream=self.config.data.shard_stream,
            overrides=overrides,
            drop_last=self.drop_last,
            per_rank_batches=self.config.data.loader_batch == "per_rank",
        )

    def widen(self, steps: Sequence[tuple[float, float]]) -> None:
        """After an epoch of ``steps`` (each its seconds waiting for the batch, and in all): when the epoch
        waited more than ``data_wait_limit`` of its time, the next one loads with more workers (none to two,
        then twice as many, up to this rank's share of the CPUs less the one its loop runs on), then, at that
        limit, with twice the prefetch (up to ``MAX_PREFETCH``); not for an epoch that waited under
        ``ADAPT_MIN_WAIT_S`` in all. Said in the log: what changed, or once why nothing can. The epoch's
        share, not a typical step's: workers that load ahead make most steps wait for nothing and a few for a
        whole round of loading."""
        data = self.config.data
        total = sum(seconds for _, seconds in steps)
        if len(steps) < ADAPT_MIN_STEPS or total <= 0:
            return
        waited = sum(waited for waited, _ in steps)
        wait = waited / total
        if wait <= data.data_wait_limit or waited < ADAPT_MIN_WAIT_S:
            return
        slow = f"rank {self.rank}: the last epoch's steps waited for their batches {wait:.0%} of their time"
        workers, prefetch = self.loader.num_workers, self.loader.prefetch_factor or 2
        cap = max(0, _cpus_per_rank() - 1)
        why = None
        if not data.adapt_workers:
            why = "adapt_workers is off: set --num-workers, or make the dataset's loading cheaper"
        elif data.num_workers is not None:
            why = f"num_workers={data.num_workers} was set for this run: kept (raise it, or leave it unset)"
        elif self.iterable:
            why = "a stream's shares follow its workers: kept (set --num-workers, or make the loading cheaper)"
        elif workers < cap:
            wider = {"num_workers": min(cap, max(2, 2 * workers)), "prefetch_factor": self.loader.prefetch_factor}
        elif workers and prefetch < MAX_PREFETCH:
            wider = {"num_workers": workers, "prefetch_factor": min(MAX_PREFETCH, 2 * prefetch)}
        else:
            why = f"{workers} workers already, this rank's share of the CPUs: the loading itself is the bottleneck"
        if why is not None:
            if not self._said_slow:
                log.warning("%s; %s", slow, why)
            self._said_slow = True
            return
        settings = self._loader_settings(self.source, workers=wider["num_workers"]) | wider
        settings["persistent_workers"] = self.loader.persistent_workers
        self.loader = self._build(settings)
        log.warning(
            "%s: the next epoch loads with %d DataLoader workers (was %d), %d batches ahead each",
            slow,
            self.loader.num_workers,
            workers,
            self.loader.prefetch_factor,
        )

    def _loader_settings(self, loader: DataLoader, workers: int | None = None) -> dict[str, Any]:
        """The run's settings over the user's loader's, ``workers`` the workers it will have (else the run's,
        else the loader's own)."""
        config = self.config.data
        if workers is None:
            workers = config.num_workers if config.num_workers is not None else loader.num_workers
        return {
            "num_workers": config.num_workers,
            "pin_memory": config.pin_memory,
            "persistent_workers": config.persistent_workers,
            "prefetch_factor": config.prefetch_factor,
            # a loader with workers and no timeout would wait for a hung worker forever
            "timeout": config.loader_stall_s if not loader.timeout and workers else None,
        }

    def micro_batch(self, accumulation: int) -> int | None:
        """For batches of every size, which the plan's (or the run's) accumulation splits: the micro-batch
        ``accumulation`` parts of a mean batch make. None where the batches are the per-rank batch."""
        if self.batches is None:
            return None
        return max(1, round(self.batches.mean_batch() / self.world / accumulation))

    def share(self, batch_in_epoch: int) -> BatchShare:
        """This rank's part of the epoch's global batch ``batch_in_epoch`` (``data.batch_share``): its samples,
        those of the global batch, and how its micro-batches' losses weigh."""
        return batch_share(self.loader, batch_in_epoch, world=self.world)

    def epoch(self, epoch: int, batches_done: int) -> Iterator[Any]:
        """The epoch's batches from ``batches_done`` on: a resumed run does not load again what its checkpoint
        trained on (the order is the same; with DataLoader workers, per-worker random augmentations draw
        differently from an uninterrupted run)."""
        set_position(self.loader, epoch=epoch, batches_done=batches_done, seed=self.seed, rank=self.rank)
        self._check_ranks_drew_alike()
        return iter(self.loader)

    def next(self, batches: Iterator[Any]) -> Any:
        """The next batch, None at the end (see ``data.next_batch``)."""
        return next_batch(batches, self.loader, stall_s=self.config.data.loader_stall_s)

    def all_ranks_have(self, has_batch: bool) -> bool:
        """Whether every rank loaded a batch. A map-style dataset gives every rank as many (DistributedView);
        a stream may end sooner on one rank, and a rank that stopped while the others step would leave them in a
        collective forever: the ranks agree per batch, over one tiny all-reduce, and stop together."""
        if not self.iterable:
            return has_batch
        return agree(has_batch, dist.ReduceOp.MIN, world=self.world, device=self.device)

    def _check_ranks_drew_alike(self) -> None:
        """Once per epoch: the ranks' samplers drew one order, else their shares overlap and miss samples."""
        if self.world == 1 or self.iterable:
            return
        view = rank_view(self.loader)
        if view is None:  # distributed_loader shares every map-style dataset out through one
            raise RuntimeError("a map-style loader without its share of the ranks' order")
        if not same_on_every_rank(view.fingerprint(), device=self.device):
            raise BadInput(
                f"the DataLoader's sampler ({type(view.sampler).__name__}) drew a different order "
                "on each rank: give it a generator (the same seed on every rank) or a set_epoch method"
            )

    def restore_seed(self, saved: dict[str, Any]) -> None:
        """The seed a checkpoint's position (``saved``) drew its order with: a resumed run replays that order,
        whatever this start drew. A checkpoint of an older redline saved none: it drew with the seed the user
        fixed, else 0."""
        fixed = fixed_seed(self.source, self.config.data.seed)
        self.seed = int(saved.get("data_seed", fixed if fixed is not None else 0))

    def batches_done(self, saved: dict[str, Any]) -> int:
        """This epoch's batches a checkpoint's position (``saved``) already trained on, in this run's per-rank
        batches. The ranks share one order (``DistributedView``), so what a checkpoint trained on is a count of
        samples of it, whatever its ranks and batch were: an elastic restart with fewer nodes goes on from the
        same sample (to a whole global batch). A stream's shares are per rank, and change with the ranks."""
        done = int(saved["batch_in_epoch"])
        if self.batches is not None:  # steps of the batch sampler's batches: each one rank's, or one step's
            # a checkpoint from before loader_batch took each of them for a global batch
            was_per_rank = saved.get("loader_batch", "global") == "per_rank"
            drawn = done * int(saved.get("world_size", self.world)) if was_per_rank else done
            return drawn // self.world if self.batches.per_rank else drawn
        batch = per_rank_batch(self.loader)
        was = (int(saved.get("world_size", self.world)), int(saved.get("per_rank_batch", batch)))
        if was == (self.world, batch):
            return done
        now = done * was[0] * was[1] // (self.world * batch)
        if self.rank == 0:
            log.warning(
                "the checkpoint was written by %d rank(s) x %d samples, this run has %d x %d: the epoch goes on "
                "from sample %d of its order%s",
                *was,
                self.world,
                batch,
                now * self.world * batch,
                " (a stream's shares change with the ranks: some samples of this epoch may be read twice or not at all)"
                if self.iterable
                else "",
            )
        return now


def _cpus_per_rank() -> int:
    """The CPUs this process may run on, shared by the ranks on this machine."""
    from redline.hw.host import usable_cpus

    return max(1, usable_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
