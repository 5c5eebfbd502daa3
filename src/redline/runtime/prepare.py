"""``redline.prepare()``: apply a plan to the user's own model, optimizer and DataLoader.

The user's loop changes by a handful of lines::

    run = redline.prepare(model, optimizer, loader, plan="plan.yaml")
    for x, y in run.micro_batches():          # was: for x, y in loader
        with run.accumulate():                 # autocast, no gradient sync until the last micro-batch
            loss = loss_fn(run.model(x), y)
            run.backward(loss)                 # was: loss.backward(); optimizer.step(); optimizer.zero_grad()

What is applied, in this order (torchtitan's order; each step is a no-op when the plan does not ask for
it, so the loop has one code path; steps 2 to 6 are the free functions of ``parallelize.py``):

1. process group (``WORLD_SIZE`` > 1) and device (``cuda:LOCAL_RANK``, else the CPU); the plan's world size
   must match the ranks that exist; a tensor-parallel plan's device mesh (``mesh.py``);
2. numerics: TF32 and ``cudnn.benchmark`` on GPUs (``apply_numerics``); every rank's parameters and buffers
   made rank 0's, so that every sharding starts from one model (``apply_same_start``); BatchNorm synchronised
   over the ranks (``apply_sync_batchnorm``); under an fp8 plan the linear layers made torchao ``Float8Linear``s
   (``apply_fp8`` of ``fp8.py``; the plan refused at the start where fp8 cannot run); tensor parallelism over
   the mesh's ``tp`` group (``tensor`` > 1; ``apply_tp`` of ``tensor_parallel.py``), before anything else
   wraps the layers;
3. activation checkpointing of each block, or each k-th (``checkpointing: full`` or ``selective``,
   ``checkpoint_every``, ``--ac-every``; ``apply_activation_checkpointing``);
4. ``torch.compile`` of each block (``compile``; ``apply_compile``);
5. data parallelism: DDP (bucket size, static graph, gradients as bucket views, a compression hook;
   ``apply_ddp``), ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``, ``apply_zero1``), or FSDP2 ``fully_shard`` per
   block then the root (ZeRO-2: ``reshard_after_forward=False``; FSDP: True), with bf16/fp16 parameters and
   fp32 reductions (``apply_fsdp``); beside tensor parallelism always FSDP2, over the mesh's ``dp`` group;
6. the optimizer, built after sharding (FSDP2 replaces the parameters): from the factory the user gave, or
   rebuilt from the ready optimizer's class, each of its groups with its settings over the parameters at the
   same module paths (``build_optimizer``);
7. precision: autocast to bf16/fp16 around each micro-batch (bf16 under fp8, outside the float8 layers), a
   GradScaler for fp16;
8. data: the user's DataLoader with every setting kept, its sampler (any) or its IterableDataset shared out
   over the ranks (one order per epoch drawn from the process's seed or the loader's generator, the same on
   every rank and again on resume), its short last batch kept or dropped as ``drop_last`` says, the
   plan's per-rank batch (without a plan, the loader's: each rank's, or with ``loader_batch="global"`` the
   global batch); each loaded batch, of any shape (tensors, tuples, dicts, ``BatchEncoding``, dataclasses,
   lists of strings), is moved to the device and split into micro-batches (``feed.py``, ``data.py``, ``batch.py``);
9. checkpoints (resume from the newest on start), step metrics (the loss is the global batch's, summed over
   the ranks in one small all-reduce per step), and with a checkpoint directory SIGTERM/SIGINT stop the run
   at the next step boundary after a checkpoint (a spot instance's preemption notice; ``stop.py``).

The state of the batch in hand is one ``BatchState`` per batch (``batch_state.py``). Out of memory inside
``accumulate()``: a smaller micro-batch made up with accumulation (``oom.py``). ``prepare()`` itself is defined
in ``api.py``, which ``import redline`` loads without torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from redline.env import REDLINE_PLAN
from redline.errors import BadInput
from redline.runtime.api import prepare
from redline.runtime.batch import to_device, tokens_per_sample
from redline.runtime.batch_state import BatchState
from redline.runtime.config import RunConfig, check_runnable, resolve_config
from redline.runtime.distributed import agree, clip_grad_norm, init_distributed
from redline.runtime.feed import Feed, micro_batches, per_rank_batch_without_plan
from redline.runtime.fp8 import apply_fp8
from redline.runtime.mesh import lay_out_ranks
from redline.runtime.oom import (
    SimulatedOutOfMemory,
    free_memory,
    in_collective,
    recorded_micro_batch,
    restart_smaller,
    smaller_micro_batch,
)
from redline.runtime.parallelize import (
    OptimizerFactory,
    ReadyOptimizer,
    apply_activation_checkpointing,
    apply_compile,
    apply_ddp,
    apply_fsdp,
    apply_numerics,
    apply_pipeline,
    apply_same_start,
    apply_sync_batchnorm,
    autocast_dtype,
    build_optimizer,
    build_scheduler,
    syncs_batchnorm,
    unfused_adam,
)
from redline.runtime.pipeline import LossFn, Pipeline
from redline.runtime.plan_fit import check_plan_fits
from redline.runtime.stop import Stopped, StopSignals
from redline.runtime.tensor_parallel import apply_tp
from redline.runtime.together import Together
from redline.runtime.whole_model import (
    expose_module,
    how_sharded,
    load_whole_state_dict,
    refuse_copies_when_sharded,
    whole_state_dict,
)
from redline.workload.structure import find_blocks, without_kv_cache

if TYPE_CHECKING:  # metrics.py is imported when a run starts (see _build_metrics)
    from redline.runtime.metrics import StepMetrics

__all__ = ["Run", "Stopped", "prepare"]

log = logging.getLogger("redline.runtime")


class Run:
    """A training run under a plan: what ``prepare()`` returns and the user's loop drives.

    The loop, one code path under every plan::

        for x, y in run.micro_batches(epochs=2):
            with run.accumulate():
                run.backward(loss_fn(run.model(x), y))   # or run.forward_backward(x, y)

    What a loop uses:

    - ``micro_batches(epochs=1)``: the micro-batches on the device, ``accumulation`` per optimizer step; the
      run resumes where its checkpoint left it, and closes at the end of the loop or at a ``break`` (a later
      call goes on from there: a loop may call it once per epoch);
    - ``epochs(n)``: for a loop per epoch, the epochs still to train, from where a checkpoint left off;
      ``micro_batches()`` inside trains the rest of that epoch;
    - ``optimizer_stepped``: whether the last ``accumulate()`` ended with an optimizer step (for code that
      runs once per step);
    - ``accumulate()``: one micro-batch: autocast, gradient sync at the batch's last micro-batch only, then
      the optimizer step (clipping, loss scaling, the scheduler);
    - ``backward(loss)``: the micro-batch's share of the batch's loss, backward;
      ``forward_backward(inputs, target)``: the model, ``loss_fn`` and the backward (a pipeline's whole step);
      in a loop of one's own over ``loader`` instead of ``micro_batches()``, each micro-batch is a whole batch;
    - ``save_checkpoint()`` and ``close(checkpoint=True)``, which ``micro_batches`` calls itself;
      ``register_for_checkpointing(*objects)``: more state in the checkpoint (a scheduler stepped by the loop,
      an EMA copy, a counter), restored as it is registered when the run resumed;
    - ``model``, ``optimizer``, ``scheduler``, ``scaler``: as wrapped, rebuilt and made for the plan;
    - ``model.module``: the model, as under DDP (on one process and under FSDP2, a handle on ``model``);
      ``state_dict()`` and ``load_state_dict(sd)``: the whole model's, full tensors on the CPU, on rank 0, under any
      sharding; ``copy.deepcopy(model)`` (an EMA, a teacher) computes with its own weights, and ``torch.save(model)``
      pickles (a sharded model says what to save instead: ``whole_model.py``);
    - ``evaluating()``: an evaluation on every rank (eval mode, no gradients; under sharding a rank that runs the
      model alone ends the run in one line, ``together.py``); ``is_main``: rank 0, for what one process does;
    - ``step`` (optimizer steps done), ``loss`` (the last step's, of the global batch), ``epoch``,
      ``batch_in_epoch`` (this rank's batches of the epoch done), ``steps_per_epoch`` and ``total_steps(epochs)``
      (known before the first step, for a scheduler's length), ``attempt`` (starts on this checkpoint directory
      before this one);
    - ``micro_batch`` and ``accumulation`` as they run now (after an out-of-memory, smaller and more),
      ``oom_events`` (one dict per change);
    - ``config`` (the ``RunConfig`` in force), ``precision``, ``sharding``; ``device``, ``world_size``, ``rank``,
      ``local_rank``, ``dp_rank`` and ``dp_size`` (the ranks that load different batches), ``mesh`` and
      ``pipeline`` (None unless the plan is tensor- or pipeline-parallel);
    - ``loader`` (this rank's DataLoader), ``metrics`` (``StepMetrics``), ``checkpointer`` (None without a
      checkpoint directory), ``summary`` (after ``close``: the run's metrics against the plan).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        data: torch.utils.data.DataLoader,
        *,
        plan: str | Path | RunConfig | None,
        scheduler: Any,
        loss_fn: LossFn | None = None,
        **overrides: Any,
    ) -> None:
        self.world_size, self.rank, self.local_rank = init_distributed()
        self.loss_fn = loss_fn
        self.pipeline: Pipeline | None = None  # the stages and their schedule, under a pipeline-parallel plan
        self.device = torch.device(f"cuda:{self.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        planned = plan if plan is not None else os.environ.get(REDLINE_PLAN) or None
        without_plan = functools.partial(per_rank_batch_without_plan, data, world=self.world_size)
        self.config = resolve_config(
            planned, overrides, world=self.world_size, say=self.rank == 0, batch_without_plan=without_plan
        )
        check_runnable(self.config.strategy, device=self.device)  # the launcher's check (fp8), on this rank's GPU
        self.mesh = lay_out_ranks(self.config.strategy, world=self.world_size, device_type=self.device.type)
        # the ranks that load different batches: all of them, except that a tensor-parallel group shares one
        self.dp_rank, self.dp_size = self.mesh.dp_rank_and_size() if self.mesh else (self.rank, self.world_size)
        self._check_precision()
        self.accumulation = self.config.strategy.accumulation
        apply_numerics(self.config.numerics, self.device)
        check_plan_fits(self.config, model, self.device, rank=self.rank)
        model = model.to(self.device)
        # a ready optimizer's groups by module path, taken before sharding replaces the parameters
        ready = ReadyOptimizer.of(optimizer, model) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        self.model = self._wrap(model)
        how = how_sharded(self.config.strategy, world=self.world_size, sharding=self.sharding)
        refuse_copies_when_sharded(self.model, how)
        # a rank-0-only evaluation of a sharded model would hang (a pipeline stage's forward gathers nothing)
        wait_s = self.config.loop.wait_for_ranks_s
        self._together = Together(
            how=None if self.pipeline else how, world=self.world_size, rank=self.rank, wait_s=wait_s
        )
        self._together.watch(self.model)
        expose_module(self.model)  # run.model.module, as under DDP (whole_model.py); after the line above: shares it
        self.optimizer = build_optimizer(self.model, ready, world=self.world_size, sharding=self.sharding)
        self._flag_unfused_adam("as asked")
        self.scheduler = build_scheduler(scheduler, self.optimizer)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.feed = Feed(data, self.config, world=self.dp_size, rank=self.dp_rank, device=self.device)
        if self.rank == 0:
            self.feed.say_batch(planned=planned is not None)
        self.micro_batch = self.feed.micro_batch(self.accumulation) or self.config.strategy.micro_batch
        self.metrics = self._build_metrics()
        self.checkpointer = None
        if self.config.checkpoint.dir:
            from redline.runtime.checkpoint import Checkpointer

            self.checkpointer = Checkpointer(self.config.checkpoint.dir)

        self.step = 0  # optimizer steps done
        self.attempt = 0  # starts of this run on its checkpoint directory before this one
        self.epoch = 0
        self.batch_in_epoch = 0  # per-rank batches of this epoch already trained on
        self.oom_events: list[dict[str, Any]] = []
        self.optimizer_stepped = False  # whether the last accumulate() ended with an optimizer step
        self._registered: list[Any] = []  # register_for_checkpointing's objects, in the order registered
        self._in_hand: BatchState | None = None  # the batch the loop is in (see _batch)
        self._epoch_scope: int | None = None  # inside epochs(): the epoch micro_batches() trains to its end
        self._closed = False  # close() ran; a later micro_batches() reopens the run
        # the last finished epoch's steps (seconds waiting for data, in all), for the next epoch's loader
        self._finished_epoch: list[tuple[float, float]] = []
        self._simulated_oom = SimulatedOutOfMemory()  # the test hook REDLINE_TEST_OOM_AT; inert without it
        self._stop_signals = StopSignals(rank=self.rank, steps_done=lambda: self.step)
        if self.checkpointer is not None:  # a stop needs the checkpoint it resumes from
            self._stop_signals.install()
        self._resume()

    # ----------------------------------------------------------------------------------- configuration

    @property
    def precision(self) -> str:
        """The plan's precision: fp32, bf16, fp16 (autocast and loss scaling) or fp8."""
        return self.config.strategy.precision

    @property
    def sharding(self) -> str:
        """The data-parallel sharding in force: the plan's (ddp, zero1, zero2, fsdp or hsdp), except that beside
        tensor or pipeline parallelism it is FSDP2 over the mesh's data ranks (DDP takes no DTensor
        parameters), whose collectives, like tensor parallelism's, run in every forward and backward."""
        return "fsdp" if self.mesh else self.config.strategy.sharding

    @property
    def loss(self) -> float | None:
        """The last optimizer step's loss, the global batch's mean over every rank (the step metrics'), the same
        on every rank; None before the first step."""
        return self.metrics.records[-1].loss if self.metrics.records else None

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in a whole epoch (one per batch of this rank's loader, every rank alike); None for
        a stream, whose length is not known ahead."""
        if self.feed.iterable:
            return None
        return len(self.feed.loader)

    def total_steps(self, epochs: int) -> int | None:
        """Optimizer steps of a run of ``epochs`` epochs from its start, ``max_steps`` the most: the length
        to give a scheduler (OneCycleLR's ``total_steps``, a warm-up-then-decay schedule). None for a stream
        without ``max_steps``."""
        whole = None if self.steps_per_epoch is None else epochs * self.steps_per_epoch
        limit = self.config.loop.max_steps
        if whole is None or limit is None:
            return whole if limit is None else limit
        return min(whole, limit)

    @property
    def loader(self) -> torch.utils.data.DataLoader:
        """The user's DataLoader as this rank loads it (``feed.py``)."""
        return self.feed.loader

    def _build_metrics(self) -> StepMetrics:
        """The step metrics (``metrics.py``), against the catalog's and the measured peak of this device."""
        from redline.runtime.metrics import StepMetrics, peak_flops

        catalog, measured = peak_flops(self.device, self.precision)
        metrics = StepMetrics(
            device=self.device,
            world_size=self.world_size,
            rank=self.rank,
            ranks_per_batch=self.config.strategy.tensor * self.config.strategy.pipeline,
            flops_per_sample=self.config.plan.training_flops_per_sample,
            tokens_per_sample=self.config.plan.tokens_per_sample,
            peak_flops_catalog=catalog,
            peak_flops_measured=measured,
            path=self.config.metrics.path,
            interval_s=self.config.metrics.interval_s,
        )
        metrics.data_workers = self.feed.loader.num_workers
        return metrics

    def _check_precision(self) -> None:
        if self.device.type == "cuda" and self.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise BadInput(f"{torch.cuda.get_device_name(self.device)} has no bf16: plan with --precision fp16")
        if self.device.type == "cpu" and self.precision == "fp16":
            raise BadInput("fp16 autocast with loss scaling needs a GPU; on the CPU plan with bf16 or fp32")

    # ------------------------------------------------------------------------------------------ wrapping

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Steps 3 to 5 of the order above (``parallelize.py``), on the model's repeated blocks."""
        without_kv_cache(model)
        if self.world_size > 1:  # before anything shards or splits the model: every rank starts from rank 0's
            apply_same_start(model, rank=self.rank, world=self.world_size, device=self.device)
            apply_sync_batchnorm(model, enabled=self.config.ddp.sync_batchnorm, device=self.device, rank=self.rank)
        blocks = [block for _, block in find_blocks(model)]
        strategy = self.config.strategy
        if strategy.precision == "fp8":  # before any parallelism wraps the layers (torchtitan's order)
            model = apply_fp8(model, rank=self.rank)
        if self.mesh is not None and self.mesh.tp is not None:
            apply_tp(model, self.mesh.tp, sequence_parallel=strategy.sequence_parallel)
        if self.mesh is not None and self.mesh.pp is not None:
            if self.loss_fn is None:
                raise BadInput(
                    "a pipeline-parallel plan computes the loss on its last stage: pass prepare(..., loss_fn=...) "
                    "and call run.forward_backward(inputs, target) in the loop"
                )
            self.pipeline, held = apply_pipeline(
                model, self.config, self.mesh, device=self.device, world=self.world_size, loss_fn=self.loss_fn
            )
            return held
        apply_activation_checkpointing(blocks, strategy)
        if self.config.numerics.compile:
            apply_compile(model, blocks)
        if self.world_size == 1:
            return model
        if self.mesh is not None:  # DDP takes no DTensor parameters: FSDP2 over the data ranks, if any
            if self.mesh.dp is None:
                return model
            return apply_fsdp(model, blocks, strategy, device=self.device, world=self.world_size, mesh=self.mesh.dp)
        if self.sharding in ("ddp", "zero1"):
            return apply_ddp(
                model,
                self.config.ddp,
                device=self.device,
                local_rank=self.local_rank,
                on_bucket_ready=self._bucket_ready,
            )
        return apply_fsdp(model, blocks, strategy, device=self.device, world=self.world_size)

    def _bucket_ready(self) -> None:
        """DDP's comm hook calls this as each gradient bucket is ready: the last mark of a backward is where
        its compute ended (``backward`` reports the wait after it as communication)."""
        if self._in_hand is not None:  # None: the user's own loss.backward(), not run.backward()
            self._in_hand.bucket_ready_mark = self.metrics.mark()

    def _flag_unfused_adam(self, why: str) -> None:
        """On a GPU, say when Adam/AdamW steps without fused=True: what the plan does not count."""
        if self.device.type == "cuda" and self.rank == 0 and unfused_adam(self.optimizer):
            log.warning(
                "%s steps without fused=True, %s: it holds one more fp32 copy of the parameters while it steps "
                "(4 bytes a parameter the plan does not count); fused=True needs none and is faster",
                type(self.optimizer).__name__,
                why,
            )

    # ------------------------------------------------------------------------------------------ the loop

    def micro_batches(self, epochs: int | None = None) -> Iterator[Any]:
        """Micro-batches on the device, ``accumulation`` per optimizer step, until the end of epoch ``epochs``
        (counted from the start of the run, so a resumed run finishes the same epochs): by default 1, or inside
        ``epochs()`` the epoch it is at. Each call ends as ``close()`` does (a checkpoint, the summary so far);
        a later call goes on from there, into the same metrics file, with the stop signals taken again."""
        until = epochs if epochs is not None else (self._epoch_scope or 1)
        if self._epoch_scope is None:  # inside epochs(), which knows the run's length, the epoch's end is not it
            self.metrics.total_steps = self.total_steps(until)
        self._reopen()
        if self.epoch >= until and self.rank == 0:
            log.warning(
                "nothing to train: the checkpoint in %s is at step %d, after epoch %d of %d (a loop per epoch: "
                "iterate run.epochs(n), which starts where the checkpoint left off; else raise epochs to go on, "
                "or give another checkpoint_dir to start again)",
                self.config.checkpoint.dir,
                self.step,
                self.epoch,
                until,
            )
        try:
            while self.epoch < until and not self._steps_done():
                if self._finished_epoch:  # loading too slow in the epoch before: more workers, where it can
                    self.feed.widen(self._finished_epoch)
                    self.metrics.data_workers = self.feed.loader.num_workers
                    self._finished_epoch = []
                first_record = len(self.metrics.records)
                yield from self._epoch()
                if self._steps_done():  # the epoch was cut short: the checkpoint goes on from this batch
                    break
                self.epoch += 1
                self.batch_in_epoch = 0
                if self.scheduler is not None and self.config.loop.scheduler_interval == "epoch":
                    self.scheduler.step()
                self._finished_epoch = [(r.data_s, r.time_s) for r in self.metrics.records[first_record:]]
        except GeneratorExit:  # the loop stopped early: a break (every rank alike), or an error in its body
            state = self._in_hand  # the batch it stopped in: every micro-batch is yielded inside one
            if state is not None and state.stepped:  # a break after the batch's optimizer step: the checkpoint
                self.batch_in_epoch += 1  # counts the batch
            # after an error the other ranks may sit in a collective: a checkpoint (collective) would hang
            self.close(checkpoint=state is None or not state.failed)
            raise
        except BaseException:  # an error, perhaps on this rank only: no collective checkpoint, just the summary
            self.close(checkpoint=False)
            raise
        self.close()

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs of ``count`` still to train, from the one a checkpoint left off, for a loop per epoch::

            for epoch in run.epochs(3):
                for x, y in run.micro_batches():  # the rest of this epoch
                    ...
                evaluate(run.model)               # once per epoch, not again for epochs done before a resume

        Ends early where the run does: ``max_steps`` reached, or an epoch left unfinished (a ``break``)."""
        self.metrics.total_steps = self.total_steps(count)
        while self.epoch < count and not self._steps_done():
            epoch = self.epoch
            self._epoch_scope = epoch + 1
            try:
                yield epoch
            finally:
                self._epoch_scope = None
            if self.epoch == epoch:  # the body did not finish the epoch: going on would repeat it
                return

    def _reopen(self) -> None:
        """A ``micro_batches()`` call after ``close()``: the stop signals taken again, the metrics reopened."""
        if not self._closed:
            return
        self._closed = False
        if self.checkpointer is not None:
            self._stop_signals.install()
        self.metrics.reopen()

    def _epoch(self) -> Iterator[Any]:
        """The epoch's micro-batches from where a checkpoint left it, a checkpoint every ``checkpoint_every``
        steps, and a stop at the step boundary after a signal."""
        batches = self.feed.epoch(self.epoch, self.batch_in_epoch)
        while True:
            with self.metrics.data_wait():
                batch = self.feed.next(batches)
            if not self.feed.all_ranks_have(batch is not None):
                return
            self.metrics.count_tokens(tokens_per_sample(batch))  # the batches' own, over the plan's
            done = yield from self._batch(to_device(batch, self.device))
            self.batch_in_epoch += 1
            if done.stop_agreed:  # a SIGTERM or SIGINT reached some rank: checkpoint here and leave
                self._stop_at_boundary()
            if self.config.checkpoint.every and self.step % self.config.checkpoint.every == 0:
                self.save_checkpoint()
            if self._steps_done():
                return

    def _steps_done(self) -> bool:
        """The run has taken ``max_steps`` optimizer steps (every rank alike: they step together)."""
        return self.config.loop.max_steps is not None and self.step >= self.config.loop.max_steps

    def _batch(self, batch: Any) -> Generator[Any, None, BatchState]:
        """The batch's micro-batches, each read by ``accumulate()`` and ``backward()`` through the batch's
        ``BatchState`` (``_in_hand``); replayed, split finer, after an agreed out-of-memory. Returns that state
        when the last micro-batch is through (``stop_agreed``: read after the batch's optimizer step)."""
        share = self.feed.share(self.batch_in_epoch)
        while True:
            parts = 1 if self.pipeline else self.accumulation  # a pipeline's schedule splits the batch itself
            micros = micro_batches(batch, parts=parts, share=share)
            state = self._in_hand = BatchState(loss_divisors=[divisor for _, divisor in micros])
            for index, (micro, _) in enumerate(micros):
                state.micro_index = index
                yield micro
                if state.replay:
                    break
            if not state.replay:
                self._in_hand = None
                return state

    @contextlib.contextmanager
    def _batch_in_hand(self) -> Iterator[BatchState]:
        """The state of the batch the loop is in (``_batch`` makes it). Outside ``micro_batches()`` (a loop of
        the user's own over ``run.loader``) each micro-batch is a whole batch: a state of its own, held while
        ``accumulate()`` or ``backward()`` runs, then dropped."""
        if self._in_hand is not None:
            yield self._in_hand
            return
        self._in_hand = BatchState(loss_divisors=[1.0])
        try:
            yield self._in_hand
        finally:
            self._in_hand = None

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """One micro-batch: autocast, no gradient sync before the last of the batch, then the optimizer step
        (outside ``micro_batches()``: after each, see ``_batch_in_hand``)."""
        self.optimizer_stepped = False
        with self._batch_in_hand() as state:
            out_of_memory = False
            with self.metrics.compute():
                try:
                    with self._no_sync(state.boundary), self._autocast(), self._together.training():
                        yield
                except torch.OutOfMemoryError as exc:
                    if in_collective(
                        world=self.world_size,
                        boundary=state.boundary,
                        sharding=self.sharding,
                        batchnorm_synced=syncs_batchnorm(self.model),
                    ):  # no agreement is possible: end here and come back smaller
                        state.failed = True
                        restart_smaller(
                            exc,
                            self.checkpointer,
                            step=self.step,
                            rank=self.rank,
                            smaller=self._smaller_micro_batch(),
                            events=self.oom_events,
                        )
                    out_of_memory = True
                except BaseException:
                    state.failed = True  # the error leaves the loop: see micro_batches
                    raise
            if agree(out_of_memory, dist.ReduceOp.MAX, world=self.world_size, device=self.device):  # any rank
                self._shrink_micro_batch(state)
                return
            if state.boundary:
                self._optimizer_step(state)

    def _autocast(self) -> torch.autocast:
        """The plan's autocast (disabled under fp32) without autocast's weight cache: each cast copy lives only
        as long as the op that saved it, so the backward (here, inside the autocast region) frees a layer's
        copies as it finishes it, and a checkpointed block's recomputation does not pile its copies up."""
        dtype = autocast_dtype(self.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False)

    def forward_backward(self, inputs: Any, target: Any) -> torch.Tensor | None:
        """One micro-batch's forward, loss (``prepare``'s ``loss_fn(output, target)``; a Hugging Face model's
        output is its logits) and backward; under a pipeline-parallel plan the whole batch through the schedule
        (the loss on the last stage). The loss, detached (None on the pipeline's other stages)."""
        if self.loss_fn is None:
            raise BadInput("run.forward_backward needs the loss: pass prepare(..., loss_fn=...)")
        if self.pipeline is None:
            output = self.model(inputs)
            loss = self.loss_fn(getattr(output, "logits", output), target)
            self.backward(loss)
            return loss.detach()
        stage_loss = self.pipeline.step(inputs, target, self.accumulation)
        if stage_loss is not None:  # each step's loss is summed over every rank, then divided by their number:
            # only the last stage has it, so it counts for the pipeline's ranks
            with self._batch_in_hand() as state:
                state.loss_sum = state.loss_sum + stage_loss * self.config.strategy.pipeline
        return stage_loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled for accumulation (and fp16 loss scaling)."""
        if self.pipeline is not None:
            raise BadInput("under pipeline parallelism the schedule runs the backward: call run.forward_backward")
        with self._batch_in_hand() as state:
            self._simulated_oom.maybe_raise(step=self.step, rank=self.rank, micro_index=state.micro_index)
            share = loss / state.loss_divisor
            state.loss_sum = state.loss_sum + share.detach()  # a tensor: reading it would sync the GPU each time
            state.bucket_ready_mark = None
            with torch.autocast(self.device.type, enabled=False):
                self.scaler.scale(share).backward()
            if state.bucket_ready_mark is not None:  # DDP reduced gradients in this backward (the boundary one)
                self.metrics.add_comm_span(state.bucket_ready_mark, self.metrics.mark())
                state.bucket_ready_mark = None

    def _no_sync(self, boundary: bool) -> contextlib.AbstractContextManager:
        if self.world_size == 1:
            return contextlib.nullcontext()
        # the wrapper's methods, looked up by name: DDP's, FSDP2's, or neither (a pipeline's stages)
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is not None:  # DDP: skip the all-reduce until the last micro-batch
            return no_sync() if not boundary else contextlib.nullcontext()
        set_requires_all_reduce = getattr(self.model, "set_requires_all_reduce", None)
        if set_requires_all_reduce is not None:  # FSDP2
            # reduce-scatter every micro-batch, so that a rank holds only its shard of the gradients, as the plan
            # counts them (skipping it would hold the whole fp32 gradient until the boundary); HSDP's all-reduce
            # across replicas waits for the boundary
            set_requires_all_reduce(boundary)
        return contextlib.nullcontext()

    def _optimizer_step(self, state: BatchState) -> None:
        """The batch's last micro-batch is done: clip, step (skipped by GradScaler on inf/nan gradients), the
        scheduler, the step's metrics, and whether some rank was asked to stop."""
        state.stepped = True
        self.optimizer_stepped = True
        self._together.stepped()
        shared, pending = self._share_step(state.loss_sum)
        with self.metrics.optimizer():
            skipped = False
            if self.config.numerics.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)
                if self.pipeline is not None:  # the norm over every stage's gradients
                    self.pipeline.clip_grad_norm_(self.config.numerics.grad_clip_norm)
                elif self.mesh is not None:  # gradients on several meshes (tensor parallelism beside FSDP2)
                    clip_grad_norm(list(self.model.parameters()), self.config.numerics.grad_clip_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.numerics.grad_clip_norm)
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if scale is not None and self.scaler.get_scale() < scale:
                skipped = True  # inf/nan gradients: GradScaler skipped the step and lowered the scale
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None and not skipped and self.config.loop.scheduler_interval == "step":
                self.scheduler.step()
        if pending is not None:
            pending.wait()
        self.step += 1
        share = self.feed.share(self.batch_in_epoch)
        self.metrics.end_step(
            samples=share.trained,
            global_samples=share.global_samples,
            loss=shared[0] / self.world_size,
            micro_batch=self.micro_batch,
            accumulation=self.accumulation,
            skipped=skipped,
        )
        state.stop_agreed = bool(shared[1] > 0)  # read after end_step's synchronisation: no extra wait

    def _share_step(self, loss_sum: torch.Tensor | float) -> tuple[torch.Tensor, Any]:
        """The step's summed loss and whether this rank was asked to stop, summed over the ranks in one small
        all-reduce per optimizer step, started before the optimizer's work so it overlaps it: the reported loss
        is the global batch's, and every rank learns of a stop at the same step boundary."""
        shared = torch.zeros(2, device=self.device)
        shared[0] = loss_sum
        shared[1] = float(self._stop_signals.requested is not None)
        if self.world_size == 1:
            return shared, None
        return shared, dist.all_reduce(shared, async_op=True)

    # ----------------------------------------------------------------------------------- stopping

    def _stop_at_boundary(self) -> NoReturn:
        """Every rank at the same step boundary: the checkpoint a restart resumes from, then exit 128+signal."""
        path = self.save_checkpoint()
        signum = self._stop_signals.requested or signal.SIGTERM  # another rank was signalled: leave as they do
        if self.rank == 0:
            log.warning("stopped after step %d; checkpoint %s", self.step, path)
        raise Stopped(128 + signum)

    # ----------------------------------------------------------------------------------- out of memory

    def _smaller_micro_batch(self) -> tuple[int, int]:
        uneven = self.feed.batches is not None
        return smaller_micro_batch(self.micro_batch, self.accumulation, uneven=uneven)

    def _shrink_micro_batch(self, state: BatchState) -> None:
        """Every rank ran this micro-batch out of memory or agreed that one did: the batch again, split finer."""
        self.micro_batch, self.accumulation = self._smaller_micro_batch()
        self.optimizer.zero_grad(set_to_none=True)
        free_memory(self.device)
        event = {"step": self.step, "micro_batch": self.micro_batch, "accumulation": self.accumulation}
        self.oom_events.append(event)
        if self.rank == 0:
            log.warning(
                "out of memory at step %d: micro-batch now %d x %d accumulation (per-rank batch unchanged)",
                self.step,
                self.micro_batch,
                self.accumulation,
            )
        state.replay = True  # _batch splits the batch again, in a new BatchState (its loss sum starts at 0)

    # ------------------------------------------------------------------------------------- checkpoints

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save ``objects`` (each with ``state_dict()`` and ``load_state_dict()``: a scheduler the loop steps
        itself, an EMA model, a counter) in every checkpoint, per rank; on a resumed run each is restored now,
        from the checkpoint resumed from. Register them in the same order on every run."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise BadInput(f"{type(obj).__name__} has no state_dict() and load_state_dict() to checkpoint")
            name = str(len(self._registered))
            self._registered.append(obj)
            saved = self.checkpointer.restored_states if self.checkpointer is not None else {}
            if name in saved:
                obj.load_state_dict(saved[name])

    def state_dict(self) -> dict[str, Any]:
        """The whole model's state dict under any sharding, for ``save_pretrained`` and friends: full (unsharded)
        tensors on the CPU under the model's own names (no DDP ``module.`` prefix), on rank 0; the other ranks
        get an empty dict. Every rank calls it (it gathers the shards)::

            state = run.state_dict()
            if run.is_main:
                run.model.module.save_pretrained("out", state_dict=state)   # or torch.save(state, path)
        """
        self._together.meet("asked for the whole model (run.state_dict())")
        return whole_state_dict(self.model, pipeline=self.pipeline is not None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole model's state dict (``state_dict()``'s, a one-process model's) into the run's model under
        any sharding, each rank taking its shard of rank 0's (the other ranks' argument is not read: pass
        ``{}``). Every rank calls it. The optimizer's state is not touched."""
        self._together.meet("loaded the whole model (run.load_state_dict())")
        load_whole_state_dict(self.model, state_dict, pipeline=self.pipeline is not None)

    @property
    def is_main(self) -> bool:
        """Rank 0: where what one process does (print, log, save a file) goes, after every rank took part in
        what gathers a sharded model (``evaluating()``, ``state_dict()``)."""
        return self.rank == 0

    def evaluating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """An evaluation on every rank: the ranks meet (a rank left alone ends the run in one line, not a
        hang), the model in eval mode without gradients under the plan's autocast; its mode as it was after::

            with run.evaluating() as model:
                loss = sum(loss_fn(model(x), y) for x, y in val_loader)   # each rank its share
        """
        return self._together.evaluating(self.model, self._autocast())

    def save_checkpoint(self) -> Path | None:
        if self.checkpointer is None:
            return None
        return self.checkpointer.save(
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            scheduler=self.scheduler,
            extra=self._position(),
            states={str(index): obj for index, obj in enumerate(self._registered)},
        )

    def _position(self) -> dict[str, int | str | None]:
        return {
            "world_size": self.dp_size,  # the ranks the batches were split over
            "loader_batch": self.config.data.loader_batch,  # what a batch sampler's batch was: a rank's, or a step's
            "per_rank_batch": self.loader.batch_size,  # None for a batch sampler's batches
            "attempt": self.attempt,
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "data_seed": self.feed.seed,  # a resumed run draws the same order
        }

    def _resume(self) -> None:
        if self.checkpointer is None:
            return
        self.attempt = self.checkpointer.count_start()
        self.metrics.continue_from(0, self.attempt)
        restored = self.checkpointer.load_latest(
            model=self.model, optimizer=self.optimizer, scaler=self.scaler, scheduler=self.scheduler
        )
        if restored is not None:
            _, extra = restored
            self.step = int(extra["step"])
            self.epoch = int(extra["epoch"])
            self.feed.restore_seed(extra)
            self.batch_in_epoch = self.feed.batches_done(extra)
            as_saved = int(extra["micro_batch"]) * int(extra["accumulation"]) == self.loader.batch_size
            if as_saved or self.feed.batches is not None:
                self.micro_batch = int(extra["micro_batch"])  # as the last attempt ran it (after an OOM: smaller)
                self.accumulation = int(extra["accumulation"])
            # the starts counted next to the checkpoints; a directory of an older redline has the saved one's
            self.attempt = max(self.attempt, int(extra.get("attempt", 0)) + 1)
            self.metrics.continue_from(self.step, self.attempt)
            if self.rank == 0:
                log.warning(
                    "resumed from step %d (epoch %d, batch %d), attempt %d",
                    self.step,
                    self.epoch,
                    self.batch_in_epoch,
                    self.attempt,
                )
            self._flag_unfused_adam("as the checkpoint had it")  # a restore brings back the saved groups' settings
        recorded = recorded_micro_batch(
            self.checkpointer, micro_batch=self.micro_batch, accumulation=self.accumulation, rank=self.rank
        )
        if recorded is not None:
            self.micro_batch, self.accumulation = recorded
            self.oom_events.append({"step": self.step, "micro_batch": recorded[0], "accumulation": recorded[1]})

    def close(self, *, checkpoint: bool = True) -> None:
        """End of training, or of this ``micro_batches()`` call: a last checkpoint, the metrics summary against
        the plan; SIGTERM and SIGINT act as without redline until the next call."""
        self._closed = True
        self._stop_signals.restore()
        if checkpoint and self.checkpointer is not None and self.checkpointer.latest_step() != self.step:
            self.save_checkpoint()
        if checkpoint and self.checkpointer is not None and self.rank == 0:
            self.checkpointer.clear_micro_batch()  # it was for the restarts of this run, not for later ones
        self.summary = self.metrics.summary(self.config.plan.predicted)
        self.metrics.close(self.config.plan.predicted)
