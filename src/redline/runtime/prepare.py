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
   must match the ranks that exist;
2. numerics: TF32 and ``cudnn.benchmark`` on GPUs (``apply_numerics``); BatchNorm synchronised over the
   ranks (``apply_sync_batchnorm``);
3. activation checkpointing of each block (``checkpointing: full``; ``apply_activation_checkpointing``);
4. ``torch.compile`` of each block (``compile``; ``apply_compile``);
5. data parallelism: DDP (bucket size, static graph, gradients as bucket views, a compression hook;
   ``apply_ddp``), ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``, ``apply_zero1``), or FSDP2 ``fully_shard`` per
   block then the root (ZeRO-2: ``reshard_after_forward=False``; FSDP: True), with bf16/fp16 parameters and
   fp32 reductions (``apply_fsdp``);
6. the optimizer, built after sharding (FSDP2 replaces the parameters): from the factory the user gave,
   or rebuilt from the ready optimizer's class and settings (``build_optimizer``);
7. precision: autocast to bf16/fp16 around each micro-batch, a GradScaler for fp16;
8. data: the user's DataLoader with every setting kept, its sampler (any) or its IterableDataset shared out
   over the ranks (deterministic per epoch, also on one rank, so a resumed run sees the same order), the
   plan's per-rank batch (without a plan, the loader's batch is the global batch); each loaded batch, of any
   shape (tensors, tuples, dicts, ``BatchEncoding``, dataclasses, lists of strings), is moved to the device
   and split into the plan's micro-batches (``data.py``, ``batch.py``);
9. checkpoints (resume from the newest on start), step metrics (the loss is the global batch's, summed over
   the ranks in one small all-reduce per step), and with a checkpoint directory SIGTERM/SIGINT stop the run
   at the next step boundary after a checkpoint (a spot instance's preemption notice).

Out of memory: a CUDA OOM inside ``accumulate()`` halves the micro-batch (to the largest divisor of the
per-rank batch at most half of it) and makes up the rest with accumulation (the per-rank batch, and so the
result, is unchanged) and replays the current batch. With several ranks all agree first, over one tiny
all-reduce per micro-batch; that is only safe where no gradient collective is in flight, i.e. under DDP on
the micro-batches before the synchronising one. Elsewhere (DDP's last micro-batch, FSDP2) the rank records
the smaller micro-batch next to the checkpoints and ends; the elastic launcher restarts every rank, and they
resume from the last checkpoint with it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from redline.errors import BadInput, RedlineError
from redline.runtime.batch import bounds, split, to_device
from redline.runtime.config import RunConfig, default_config, from_plan_file
from redline.runtime.data import (
    DistributedBatches,
    batches_vary,
    distributed_loader,
    loader_batch,
    next_batch,
    rank_view,
    set_position,
)
from redline.runtime.parallelize import (
    OptimizerFactory,
    apply_activation_checkpointing,
    apply_compile,
    apply_ddp,
    apply_fsdp,
    apply_numerics,
    apply_sync_batchnorm,
    build_optimizer,
    unfused_adam,
)
from redline.workload.structure import find_blocks, without_kv_cache

log = logging.getLogger("redline.runtime")

# a test hook: "STEP:RANK[:MICRO]" raises an out-of-memory error at that optimizer step, on that rank, in that
# micro-batch (0 by default), once, in the first launch attempt only
OOM_HOOK_ENV = "REDLINE_TEST_OOM_AT"
EXIT_WAIT_S = 5.0  # how long a rank leaving waits for the others at exit (see _destroy_process_group)


class OutOfMemoryAtMinimum(RedlineError):
    """Even a micro-batch of one sample does not fit."""


class OutOfMemoryDuringCollective(RedlineError):
    """Out of memory where the ranks cannot agree in place; a restart resumes with a smaller micro-batch."""


class Stopped(SystemExit):
    """Asked to stop by a signal, the run checkpointed at a step boundary: exits 128 + the signal's number
    (SystemExit: no traceback, and the code after the user's loop does not run as if training had finished)."""


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    data: torch.utils.data.DataLoader,
    *,
    plan: str | Path | RunConfig | None = None,
    scheduler: Any = None,
    **overrides: Any,
) -> Run:
    """Apply ``plan`` (a plan file, a RunConfig, ``$REDLINE_PLAN``, or defaults for this machine) and
    return the ``Run`` whose ``model``, ``optimizer`` and ``micro_batches()`` the loop uses. ``overrides``
    set RunConfig fields (``checkpoint_dir=...``, ``metrics_path=...``)."""
    return Run(model, optimizer, data, plan=plan, scheduler=scheduler, **overrides)


class Run:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        data: torch.utils.data.DataLoader,
        *,
        plan: str | Path | RunConfig | None,
        scheduler: Any,
        **overrides: Any,
    ) -> None:
        self.world_size, self.rank, self.local_rank = _init_distributed()
        self._batchnorm_synced = False  # SyncBatchNorm layers: collectives in every forward and backward
        self.device = torch.device(f"cuda:{self.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        self.config = self._resolve_config(plan, data, overrides)
        strategy = self.config.strategy
        if strategy.data != self.world_size:
            raise BadInput(
                f"the plan is for {strategy.data} data-parallel ranks but {self.world_size} are running; "
                f"launch with `redline run --nproc-per-node {strategy.data}` or re-plan"
            )
        self.precision = strategy.precision
        self._check_precision()
        self.micro_batch = strategy.micro_batch
        self.accumulation = strategy.accumulation
        apply_numerics(self.config, self.device)
        self._check_plan_matches(model)
        self.model = self._wrap(model.to(self.device))
        self.optimizer = build_optimizer(self.model, optimizer, world=self.world_size, sharding=strategy.sharding)
        self._flag_unfused_adam("as asked")
        self.scheduler = self._build_scheduler(scheduler)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.loader = self._prepare_loader(data)

        from redline.runtime.metrics import StepMetrics, peak_flops

        catalog, measured = peak_flops(self.device, self.precision)
        self.metrics = StepMetrics(
            device=self.device,
            world_size=self.world_size,
            rank=self.rank,
            flops_per_sample=self.config.training_flops_per_sample,
            tokens_per_sample=self.config.tokens_per_sample,
            peak_flops_catalog=catalog,
            peak_flops_measured=measured,
            path=self.config.metrics_path,
            interval_s=self.config.metrics_interval_s,
        )
        self.checkpointer = None
        if self.config.checkpoint_dir:
            from redline.runtime.checkpoint import Checkpointer

            self.checkpointer = Checkpointer(self.config.checkpoint_dir)

        self.step = 0  # optimizer steps done
        self.attempt = 0  # starts of this run on its checkpoint directory before this one
        self.epoch = 0
        self.batch_in_epoch = 0  # per-rank batches of this epoch already trained on
        self.oom_events: list[dict[str, Any]] = []
        self._micro_index = 0
        self._last_micro = self.accumulation == 1  # the micro-batch in hand ends its batch
        self._micro_divisor = float(self.accumulation)  # its loss over this is its share of the batch's mean
        self._retry = False
        self._loss_sum = 0.0
        self._oom_hook = _parse_oom_hook(os.environ.get(OOM_HOOK_ENV))
        self._last_bucket_ready: Any = None  # metrics.mark() of the last DDP bucket ready in this backward
        self._failed = False  # an error left a micro-batch: the loop ends without a collective checkpoint
        self._stepped = False  # the current batch's optimizer step is done
        self._stop: int | None = None  # the signal that asked this rank to stop
        self._stop_agreed = False  # some rank was asked: all checkpoint at this step's end and leave
        self._previous_handlers = self._catch_stop_signals()
        self._resume()

    # ----------------------------------------------------------------------------------- configuration

    def _resolve_config(self, plan: Any, data: torch.utils.data.DataLoader, overrides: dict) -> RunConfig:
        if isinstance(plan, RunConfig):
            return plan.replace(**overrides) if overrides else plan
        path = plan if plan is not None else os.environ.get("REDLINE_PLAN")
        if path:
            return from_plan_file(path, **overrides)
        batch = loader_batch(data)
        if batch is None:  # a batch sampler of the user's own: each batch it draws is a global batch
            if data.batch_sampler is None:
                raise BadInput(
                    "the DataLoader has batch_size=None: give it the batch size (a global batch, without a plan)"
                )
            if self.world_size > 1 and self.rank == 0:
                log.warning(
                    "no plan: each batch of the batch sampler is a global batch, split over %d ranks", self.world_size
                )
            batch = self.world_size  # a placeholder: the batches set the micro-batch (_prepare_loader)
        if batch % self.world_size:
            raise BadInput(
                f"without a plan the loader's batch of {batch} is the global batch, which {self.world_size} ranks "
                f"cannot share evenly: give the loader a multiple of {self.world_size}, or a plan"
            )
        if self.world_size > 1 and self.rank == 0 and not batches_vary(data):
            log.warning(
                "no plan: the loader's batch of %d is the global batch, %d per rank over %d ranks",
                batch,
                batch // self.world_size,
                self.world_size,
            )
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        config = default_config(self.world_size, batch // self.world_size, cuda=torch.cuda.is_available(), bf16=bf16)
        return config.replace(**overrides) if overrides else config

    def _check_precision(self) -> None:
        if self.device.type == "cuda" and self.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise BadInput(f"{torch.cuda.get_device_name(self.device)} has no bf16: plan with --precision fp16")
        if self.device.type == "cpu" and self.precision == "fp16":
            raise BadInput("fp16 autocast with loss scaling needs a GPU; on the CPU plan with bf16 or fp32")

    def _check_plan_matches(self, model: nn.Module) -> None:
        """A plan made for other hardware, or for another model, still runs (its strategy may suit), but its
        predictions do not hold here: said once."""
        if self.rank != 0:
            return
        planned, here = self.config.planned_device, _device_name(self.device)
        if planned and _device_kind(planned) != _device_kind(here):
            log.warning(
                "the plan was made for %s and runs on %s: its memory and time predictions do not apply", planned, here
            )
        if self.config.planned_params:
            count = sum(p.numel() for p in model.parameters())
            if abs(count - self.config.planned_params) > 0.05 * self.config.planned_params:
                log.warning(
                    "the model has %s parameters and the plan was made for %s: is it the planned model?",
                    f"{count:,}",
                    f"{self.config.planned_params:,}",
                )

    # ------------------------------------------------------------------------------------------ wrapping

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Steps 3 to 5 of the order above (``parallelize.py``), on the model's repeated blocks."""
        without_kv_cache(model)
        if self.world_size > 1:
            self._batchnorm_synced = apply_sync_batchnorm(
                model, enabled=self.config.sync_batchnorm, device=self.device, rank=self.rank
            )
        blocks = [block for _, block in find_blocks(model)]
        strategy = self.config.strategy
        apply_activation_checkpointing(blocks, strategy.checkpointing)
        if self.config.compile:
            apply_compile(model, blocks)
        if self.world_size == 1:
            return model
        if strategy.sharding in ("ddp", "zero1"):
            return apply_ddp(
                model, self.config, device=self.device, local_rank=self.local_rank, on_bucket_ready=self._bucket_ready
            )
        return apply_fsdp(model, blocks, strategy, device=self.device, world=self.world_size)

    def _bucket_ready(self) -> None:
        self._last_bucket_ready = self.metrics.mark()

    def _flag_unfused_adam(self, why: str) -> None:
        """On a GPU, say when Adam/AdamW steps without fused=True: what the plan does not count."""
        if self.device.type == "cuda" and self.rank == 0 and unfused_adam(self.optimizer):
            log.warning(
                "%s steps without fused=True, %s: it holds one more fp32 copy of the parameters while it steps "
                "(4 bytes a parameter the plan does not count); fused=True needs none and is faster",
                type(self.optimizer).__name__,
                why,
            )

    def _build_scheduler(self, scheduler: Any) -> Any:
        """A ready LR scheduler must drive the optimizer in use; where that was rebuilt (FSDP2, ZeRO-1), pass
        a factory (``scheduler=lambda optimizer: ...``) so it is built on the new one."""
        if scheduler is None:
            return None
        if not hasattr(scheduler, "step"):
            return scheduler(self.optimizer)
        if getattr(scheduler, "optimizer", self.optimizer) is not self.optimizer:
            raise BadInput(
                "the optimizer was rebuilt after sharding, so the scheduler would drive the old one: "
                "pass scheduler=lambda optimizer: YourScheduler(optimizer, ...)"
            )
        return scheduler

    def _prepare_loader(self, loader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        """The user's DataLoader for this rank: every setting kept, its sampler or stream shared out over the
        ranks, the plan's per-rank batch (``runtime/data.py``)."""
        given = loader_batch(loader)
        if given not in (None, self.config.per_rank_batch) and self.rank == 0:
            log.info(
                "loader batch size %s replaced by the per-rank batch %s (micro-batch %s x accumulation %s)",
                given,
                self.config.per_rank_batch,
                self.micro_batch,
                self.accumulation,
            )
        self._iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        workers = self.config.num_workers if self.config.num_workers is not None else loader.num_workers
        prepared = distributed_loader(
            loader,
            world=self.world_size,
            rank=self.rank,
            per_rank_batch=self.config.per_rank_batch,
            seed=self.config.seed,
            shard_stream=self.config.shard_stream,
            overrides={
                "num_workers": self.config.num_workers,
                "pin_memory": self.config.pin_memory,
                "persistent_workers": self.config.persistent_workers,
                "prefetch_factor": self.config.prefetch_factor,
                # a loader with workers and no timeout would wait for a hung worker forever
                "timeout": self.config.loader_stall_s if not loader.timeout and workers else None,
            },
        )
        self._batches = prepared.batch_sampler if isinstance(prepared.batch_sampler, DistributedBatches) else None
        if self._batches is not None:
            # the batches set the per-rank batch; the plan's (or the run's) accumulation splits each of them
            mean = self._batches.mean_batch() / self.world_size
            self.micro_batch = max(1, round(mean / self.accumulation))
            if self.rank == 0:
                log.info(
                    "the batch sampler's batches are kept: %.1f samples per global batch on average, each split in "
                    "%d micro-batch(es) per rank",
                    self._batches.mean_batch(),
                    self.accumulation,
                )
        return prepared

    def _batch_size(self) -> int:
        """Samples in this rank's current batch (a batch sampler's batches vary; otherwise the per-rank batch)."""
        if self._batches is None:
            return self.loader.batch_size
        return self._batches.sizes[self.batch_in_epoch]

    # ------------------------------------------------------------------------------------------ the loop

    def micro_batches(self, epochs: int = 1) -> Iterator[Any]:
        """Micro-batches on the device, ``accumulation`` per optimizer step, for ``epochs`` epochs (counted
        from the start of the run, so a resumed run finishes the same epochs)."""
        if self.epoch >= epochs and self.rank == 0:
            log.warning(
                "nothing to train: the checkpoint in %s is at step %d, after epoch %d of %d (raise epochs to go on, "
                "or give another checkpoint_dir to start again)",
                self.config.checkpoint_dir,
                self.step,
                self.epoch,
                epochs,
            )
        try:
            while self.epoch < epochs:
                # resumed mid-epoch: the sampler (or stream) starts after what the checkpoint already trained on,
                # so those samples are not loaded again (the order is the same; with DataLoader workers,
                # per-worker random augmentations draw differently from an uninterrupted run)
                set_position(
                    self.loader,
                    epoch=self.epoch,
                    batches_done=self.batch_in_epoch,
                    seed=self.config.seed,
                    rank=self.rank,
                )
                self._check_ranks_drew_alike()
                batches = iter(self.loader)
                while True:
                    with self.metrics.data_wait():
                        batch = next_batch(batches, self.loader, stall_s=self.config.loader_stall_s)
                    if not self._all_ranks_have(batch is not None):
                        break
                    batch = to_device(batch, self.device)
                    self._stepped = False  # set by this batch's optimizer step
                    size = self._batch_size()
                    while True:  # replays the batch, split finer, after an agreed out-of-memory
                        self._retry = False
                        micros = split(batch, self.accumulation, size, uneven=self._batches is not None)
                        edges = bounds(size, len(micros))
                        for index, micro in enumerate(micros):
                            self._micro_index = index
                            self._last_micro = index == len(micros) - 1
                            # its loss's share of the batch's mean: 1 / accumulation, or its samples' share
                            self._micro_divisor = size / (edges[index + 1] - edges[index])
                            yield micro
                            if self._retry:
                                break
                        if not self._retry:
                            break
                    self.batch_in_epoch += 1
                    if self._stop_agreed:  # a SIGTERM or SIGINT reached some rank: checkpoint here and leave
                        self._stop_at_boundary()
                    if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
                        self.save_checkpoint()
                self.epoch += 1
                self.batch_in_epoch = 0
        except GeneratorExit:  # the loop stopped early: a break (every rank alike), or an error in its body
            if self._stepped:  # a break after the batch's optimizer step: the checkpoint counts the batch
                self.batch_in_epoch += 1
            # after an error the other ranks may sit in a collective: a checkpoint (collective) would hang
            self.close(checkpoint=not self._failed)
            raise
        except BaseException:  # an error, perhaps on this rank only: no collective checkpoint, just the summary
            self.close(checkpoint=False)
            raise
        self.close()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """One micro-batch: autocast, no gradient sync before the last of the step, then the optimizer step."""
        boundary = self._last_micro
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        failed = False
        with self.metrics.compute():
            try:
                # without autocast's weight cache: each cast copy lives only as long as the op that saved it, so
                # the backward (here, inside the autocast region) frees a layer's copies as it finishes it, and a
                # checkpointed block's recomputation does not pile its copies up in the cache
                autocast = torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False)
                with self._no_sync(boundary), autocast:
                    yield
            except torch.OutOfMemoryError as exc:
                in_collective = boundary or self.config.strategy.sharding != "ddp" or self._batchnorm_synced
                if self.world_size > 1 and in_collective:
                    # the other ranks are inside a collective (DDP's sync step, FSDP2's gathers and
                    # reduce-scatters, SyncBatchNorm's statistics in every forward and backward): no agreement
                    # is possible, so end here and come back smaller
                    self._failed = True
                    self._restart_smaller(exc)
                failed = True
            except BaseException:
                self._failed = True  # the error leaves the loop: see micro_batches
                raise
        if self._any_rank(failed):
            self._shrink_micro_batch()
            return
        if boundary:
            self._optimizer_step()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled for accumulation (and fp16 loss scaling)."""
        self._maybe_raise_test_oom()
        share = loss / self._micro_divisor
        self._loss_sum = self._loss_sum + share.detach()  # a tensor: reading it would sync the GPU every micro-batch
        self._last_bucket_ready = None
        with torch.autocast(self.device.type, enabled=False):
            self.scaler.scale(share).backward()
        if self._last_bucket_ready is not None:  # DDP reduced gradients in this backward (the boundary one)
            self.metrics.add_comm_span(self._last_bucket_ready, self.metrics.mark())
            self._last_bucket_ready = None

    def _no_sync(self, boundary: bool) -> contextlib.AbstractContextManager:
        if self.world_size == 1:
            return contextlib.nullcontext()
        if hasattr(self.model, "no_sync"):  # DDP: skip the all-reduce until the last micro-batch
            return self.model.no_sync() if not boundary else contextlib.nullcontext()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def _optimizer_step(self) -> None:
        self._stepped = True
        shared, pending = self._share_step()
        with self.metrics.optimizer():
            skipped = False
            if self.config.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip_norm)
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if scale is not None and self.scaler.get_scale() < scale:
                skipped = True  # inf/nan gradients: GradScaler skipped the step and lowered the scale
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None and not skipped:
                self.scheduler.step()
        if pending is not None:
            pending.wait()
        self.step += 1
        self.metrics.end_step(
            samples=self._batch_size(),
            loss=shared[0] / self.world_size,
            micro_batch=self.micro_batch,
            accumulation=self.accumulation,
            skipped=skipped,
        )
        self._loss_sum = 0.0
        self._stop_agreed = bool(shared[1] > 0)  # read after end_step's synchronisation: no extra wait

    def _share_step(self) -> tuple[torch.Tensor, Any]:
        """The step's summed loss and whether this rank was asked to stop, summed over the ranks in one small
        all-reduce per optimizer step, started before the optimizer's work so it overlaps it: the reported loss
        is the global batch's, and every rank learns of a stop at the same step boundary."""
        shared = torch.zeros(2, device=self.device)
        shared[0] = self._loss_sum
        shared[1] = float(self._stop is not None)
        if self.world_size == 1:
            return shared, None
        return shared, dist.all_reduce(shared, async_op=True)

    # -------------------------------------------------------------------------------- ranks in step

    def _all_ranks_have(self, has_batch: bool) -> bool:
        """Whether every rank loaded a batch. A map-style dataset gives every rank as many (DistributedView);
        a stream may end sooner on one rank, and a rank that stopped while the others step would leave them in a
        collective forever: the ranks agree per batch, over one tiny all-reduce, and stop together."""
        if not self._iterable:
            return has_batch
        return self._agree(has_batch, dist.ReduceOp.MIN)

    def _check_ranks_drew_alike(self) -> None:
        """Once per epoch: the ranks' samplers drew one order, else their shares overlap and miss samples."""
        if self.world_size == 1 or self._iterable:
            return
        view = rank_view(self.loader)
        mine = view.fingerprint()
        value = torch.tensor([mine, -mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if value[0].item() != -value[1].item():
            raise BadInput(
                f"the DataLoader's sampler ({type(view.sampler).__name__}) drew a different order "
                "on each rank: give it a generator (the same seed on every rank) or a set_epoch method"
            )

    # ----------------------------------------------------------------------------------- stopping

    def _catch_stop_signals(self) -> dict[int, Any]:
        """With a checkpoint directory, SIGTERM (a spot instance's preemption notice, torchrun stopping its
        workers) and SIGINT end the run at the next step boundary, after a checkpoint, instead of at once. A
        second Ctrl-C acts as it would have; a second SIGTERM is the same request again (one sent to a process
        group reaches the script directly and through its launcher). Only the main thread can take signals; a
        process forked from it (DataLoader workers set their own SIGTERM handler) leaves as it would have."""
        if self.checkpointer is None or threading.current_thread() is not threading.main_thread():
            return {}
        self._signal_pid = os.getpid()
        handlers = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, self._on_stop_signal)
        return handlers

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._signal_pid:  # a process forked from this one inherited the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._stop is not None and signum == signal.SIGTERM:
            return  # the same request again
        if self._stop is not None:  # a second Ctrl-C: as if redline were not there
            previous = self._previous_handlers.get(signum, signal.SIG_DFL)
            self._restore_signals()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self._stop = signum
        if self.rank == 0:
            log.warning(
                "%s: checkpointing at the end of step %d, then stopping (send it again to stop at once)",
                signal.Signals(signum).name,
                self.step + 1,
            )

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # close() from a garbage-collected generator elsewhere: only the main thread may
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def _stop_at_boundary(self) -> NoReturn:
        """Every rank at the same step boundary: the checkpoint a restart resumes from, then exit 128+signal."""
        path = self.save_checkpoint()
        signum = self._stop or signal.SIGTERM  # another rank was signalled; this one leaves as they do
        if self.rank == 0:
            log.warning("stopped after step %d; checkpoint %s", self.step, path)
        raise Stopped(128 + signum)

    # ----------------------------------------------------------------------------------- out of memory

    def _any_rank(self, flag: bool) -> bool:
        """Whether any rank hit out-of-memory in this micro-batch: every rank asks, so all decide alike."""
        return self._agree(flag, dist.ReduceOp.MAX)

    def _agree(self, flag: bool, op: dist.ReduceOp) -> bool:
        """One flag reduced over the ranks in a tiny all-reduce (MAX: any rank; MIN: every rank)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=op)
        return bool(value.item())

    def _smaller_micro_batch(self) -> tuple[int, int]:
        """(micro-batch, accumulation): the largest micro-batch at most half the current one that still divides
        the per-rank batch, and the accumulation that makes it up (so the result stays the same)."""
        if self._batches is not None:  # batches of every size: each split in twice as many parts
            if self.micro_batch == 1:
                raise OutOfMemoryAtMinimum("out of memory with a micro-batch of 1: the plan does not fit this GPU")
            return max(1, self.micro_batch // 2), self.accumulation * 2
        per_rank = self.micro_batch * self.accumulation
        smaller = next((m for m in range(self.micro_batch // 2, 0, -1) if per_rank % m == 0), None)
        if smaller is None:
            raise OutOfMemoryAtMinimum("out of memory with a micro-batch of 1: the plan does not fit this GPU")
        return smaller, per_rank // smaller

    def _shrink_micro_batch(self) -> None:
        self.micro_batch, self.accumulation = self._smaller_micro_batch()
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_sum = 0.0
        gc.collect()  # the failed micro-batch's frames and activations
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        event = {"step": self.step, "micro_batch": self.micro_batch, "accumulation": self.accumulation}
        self.oom_events.append(event)
        if self.rank == 0:
            log.warning(
                "out of memory at step %d: micro-batch now %d x %d accumulation (per-rank batch unchanged)",
                self.step,
                self.micro_batch,
                self.accumulation,
            )
        self._retry = True

    def _restart_smaller(self, exc: torch.OutOfMemoryError) -> NoReturn:
        """Out of memory where the ranks cannot agree in place: record the smaller micro-batch next to the
        checkpoints and end this process. The elastic launcher (``redline run``, torchrun) then restarts every
        rank, and each resumes from the last checkpoint with the recorded micro-batch (``_resume``)."""
        smaller, accumulation = self._smaller_micro_batch()
        where = f"out of memory at step {self.step} on rank {self.rank} inside a gradient collective"
        if self.checkpointer is None:
            raise OutOfMemoryDuringCollective(
                f"{where}: set checkpoint_dir so that a restart resumes with micro-batch {smaller}, "
                f"or plan with a micro-batch of {smaller}"
            ) from exc
        self.checkpointer.record_micro_batch(smaller, accumulation)
        self.oom_events.append({"step": self.step, "micro_batch": smaller, "accumulation": accumulation})
        raise OutOfMemoryDuringCollective(
            f"{where}: recorded micro-batch {smaller} x {accumulation} accumulation in "
            f"{self.checkpointer.directory}; the launcher's restart resumes from the last checkpoint with it"
        ) from exc

    def _maybe_raise_test_oom(self) -> None:
        """The REDLINE_TEST_OOM_AT hook: an out-of-memory error in a micro-batch's backward, in the first launch
        attempt only (a restarted run must not meet it again)."""
        if self._oom_hook == (self.step, self.rank, self._micro_index):
            self._oom_hook = None
            raise torch.OutOfMemoryError(f"{OOM_HOOK_ENV}: simulated out of memory at step {self.step}")

    # ------------------------------------------------------------------------------------- checkpoints

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
        )

    def _position(self) -> dict[str, int]:
        return {
            "world_size": self.world_size,
            "per_rank_batch": self.loader.batch_size,  # None for a batch sampler's batches
            "attempt": self.attempt,
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
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
            self.batch_in_epoch = self._batches_done(extra)
            as_saved = int(extra["micro_batch"]) * int(extra["accumulation"]) == self.loader.batch_size
            if as_saved or self._batches is not None:
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
        recorded = self.checkpointer.recorded_micro_batch()
        if recorded is not None:
            micro, accumulation = recorded
            if self.rank == 0:
                log.warning(
                    "%s records micro-batch %d x %d after an out-of-memory; it is cleared when the run completes",
                    self.checkpointer.micro_batch_path,
                    micro,
                    accumulation,
                )
            if micro < self.micro_batch and micro * accumulation == self.micro_batch * self.accumulation:
                self.micro_batch, self.accumulation = micro, accumulation
                self.oom_events.append({"step": self.step, "micro_batch": micro, "accumulation": accumulation})
                if self.rank == 0:
                    log.warning(
                        "micro-batch %d x %d accumulation, as recorded after an out-of-memory in a gradient collective",
                        micro,
                        accumulation,
                    )

    def _batches_done(self, saved: dict[str, Any]) -> int:
        """This epoch's batches already trained on, in this run's per-rank batches. The ranks share one order
        (``DistributedView``), so what a checkpoint trained on is a count of samples of it, whatever its ranks
        and batch were: an elastic restart with fewer nodes goes on from the same sample (to a whole global
        batch). A stream's shares are per rank, and change with the ranks."""
        done = int(saved["batch_in_epoch"])
        if self._batches is not None:  # the batch sampler's batches are global batches, whatever the ranks
            return done
        was = (int(saved.get("world_size", self.world_size)), int(saved.get("per_rank_batch", self.loader.batch_size)))
        if was == (self.world_size, self.loader.batch_size):
            return done
        samples = done * was[0] * was[1]
        now = samples // (self.world_size * self.loader.batch_size)
        if self.rank == 0:
            log.warning(
                "the checkpoint was written by %d rank(s) x %d samples, this run has %d x %d: the epoch goes on "
                "from sample %d of its order%s",
                *was,
                self.world_size,
                self.loader.batch_size,
                now * self.world_size * self.loader.batch_size,
                " (a stream's shares change with the ranks: some samples of this epoch may be read twice or not at all)"
                if self._iterable
                else "",
            )
        return now

    def close(self, *, checkpoint: bool = True) -> None:
        """End of training: a last checkpoint, the metrics summary against the plan."""
        self._restore_signals()
        if checkpoint and self.checkpointer is not None and self.checkpointer.latest_step() != self.step:
            self.save_checkpoint()
        if checkpoint and self.checkpointer is not None and self.rank == 0:
            self.checkpointer.clear_micro_batch()  # it was for the restarts of this run, not for later ones
        self.summary = self.metrics.summary(self.config.predicted)
        self.metrics.close(self.config.predicted)


# ----------------------------------------------------------------------------------------------- helpers


def _init_distributed() -> tuple[int, int, int]:
    """(world size, rank, local rank): from an initialised process group, else from torchrun's environment
    (initialising the group: NCCL on GPUs, gloo on CPUs), else a single process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        # the launcher's store outlives a restart, and a restarted gloo group would read the addresses the
        # failed attempt's ranks published there and time out connecting to them: each attempt gets its own
        # keys (seen with torchrun in torch 2.13)
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"redline/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank, world_size=world
        )
        # a group left alive at interpreter exit can abort in its threads' destructors ("terminate called
        # without an active exception"): the group redline made, redline tears down
        atexit.register(_destroy_process_group, store, world)
        return dist.get_world_size(), dist.get_rank(), local
    return 1, 0, 0


def _destroy_process_group(store: dist.Store, world: int) -> None:
    """Leave together: a rank that tears its gloo connections down while a peer still reads them can abort
    the peer ("terminate called without an active exception", about one 2-rank run in eight). The ranks meet
    over the store, not in a collective, so a rank that fails while its peers sit in another collective
    cannot mismatch it: it waits at most ``EXIT_WAIT_S`` and goes."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # the launcher's store already gone: nobody left to wait for
        store.add("exit", 1)
        deadline = time.monotonic() + EXIT_WAIT_S
        while store.add("exit", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    dist.destroy_process_group()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _device_kind(name: str) -> str:
    """What decides a plan's figures in a device's name: its model (H100, A100, L40S, MI300X), or cpu."""
    import re

    if "cpu" in name.lower():
        return "cpu"
    models = re.findall(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.upper())
    return models[0] if models else name.lower()


def _parse_oom_hook(text: str | None) -> tuple[int, int, int] | None:
    """``STEP:RANK[:MICRO]`` (micro-batch index within the step, 0 by default); ignored in a restart."""
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    step, rank, micro, *_ = [*text.split(":"), "0", "0"]
    return int(step), int(rank or 0), int(micro or 0)
