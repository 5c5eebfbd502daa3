"""``redline.prepare()``: apply a plan to the user's own model, optimizer and DataLoader.

The user's loop changes by a handful of lines::

    run = redline.prepare(model, optimizer, loader, plan="plan.yaml")
    for x, y in run.micro_batches():          # was: for x, y in loader
        with run.accumulate():                 # autocast, no gradient sync until the last micro-batch
            loss = loss_fn(run.model(x), y)
            run.backward(loss)                 # was: loss.backward(); optimizer.step(); optimizer.zero_grad()

What is applied, in this order (torchtitan's order; each step is a no-op when the plan does not ask for
it, so the loop has one code path):

1. process group (``WORLD_SIZE`` > 1) and device (``cuda:LOCAL_RANK``, else the CPU); the plan's world size
   must match the ranks that exist;
2. numerics: TF32 and ``cudnn.benchmark`` on GPUs;
3. activation checkpointing of each block (``checkpointing: full``);
4. ``torch.compile`` of each block (``compile``);
5. data parallelism: DDP (bucket size, static graph, gradients as bucket views, a compression hook),
   ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``), or FSDP2 ``fully_shard`` per block then the root
   (ZeRO-2: ``reshard_after_forward=False``; FSDP: True), with bf16/fp16 parameters and fp32 reductions;
6. the optimizer, built after sharding (FSDP2 replaces the parameters): from the factory the user gave,
   or rebuilt from the ready optimizer's class and settings;
7. precision: autocast to bf16/fp16 around each micro-batch, a GradScaler for fp16;
8. data: a DistributedSampler (deterministic shuffling per epoch, also on one rank, so a resumed run sees
   the same order), the plan's per-rank batch, DataLoader workers and pinning; each loaded batch is split
   into the plan's micro-batches;
9. checkpoints (resume from the newest on start) and step metrics.

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
import inspect
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from redline.errors import BadInput, RedlineError
from redline.runtime.config import RunConfig, default_config, from_plan_file

log = logging.getLogger("redline.runtime")

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
# a test hook: "STEP:RANK[:MICRO]" raises an out-of-memory error at that optimizer step, on that rank, in that
# micro-batch (0 by default), once, in the first launch attempt only
OOM_HOOK_ENV = "REDLINE_TEST_OOM_AT"
EXIT_WAIT_S = 5.0  # how long a rank leaving waits for the others at exit (see _destroy_process_group)


class OutOfMemoryAtMinimum(RedlineError):
    """Even a micro-batch of one sample does not fit."""


class OutOfMemoryDuringCollective(RedlineError):
    """Out of memory where the ranks cannot agree in place; a restart resumes with a smaller micro-batch."""


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
        self._apply_numerics()
        self.model = self._wrap(model.to(self.device))
        self.optimizer = self._build_optimizer(optimizer)
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
        self.epoch = 0
        self.batch_in_epoch = 0  # per-rank batches of this epoch already trained on
        self.oom_events: list[dict[str, Any]] = []
        self._micro_index = 0
        self._retry = False
        self._loss_sum = 0.0
        self._oom_hook = _parse_oom_hook(os.environ.get(OOM_HOOK_ENV))
        self._last_bucket_ready: Any = None  # metrics.mark() of the last DDP bucket ready in this backward
        self._failed = False  # an error left a micro-batch: the loop ends without a collective checkpoint
        self._resume()

    # ----------------------------------------------------------------------------------- configuration

    def _resolve_config(self, plan: Any, data: torch.utils.data.DataLoader, overrides: dict) -> RunConfig:
        if isinstance(plan, RunConfig):
            return plan.replace(**overrides) if overrides else plan
        path = plan if plan is not None else os.environ.get("REDLINE_PLAN")
        if path:
            return from_plan_file(path, **overrides)
        batch = data.batch_size or 1
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        config = default_config(self.world_size, batch, cuda=torch.cuda.is_available(), bf16=bf16)
        return config.replace(**overrides) if overrides else config

    def _check_precision(self) -> None:
        if self.device.type == "cuda" and self.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise BadInput(f"{torch.cuda.get_device_name(self.device)} has no bf16: plan with --precision fp16")
        if self.device.type == "cpu" and self.precision == "fp16":
            raise BadInput("fp16 autocast with loss scaling needs a GPU; on the CPU plan with bf16 or fp32")

    def _apply_numerics(self) -> None:
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.config.tf32
            torch.backends.cudnn.allow_tf32 = self.config.tf32
            torch.backends.cudnn.benchmark = self.config.cudnn_benchmark

    # ------------------------------------------------------------------------------------------ wrapping

    def _wrap(self, model: nn.Module) -> nn.Module:
        from redline.workload.trace import find_blocks, without_kv_cache

        without_kv_cache(model)
        blocks = find_blocks(model)
        strategy = self.config.strategy
        if strategy.checkpointing == "selective":
            raise BadInput(
                "selective activation checkpointing is not applied by the runtime yet: plan with none or full"
            )
        if strategy.checkpointing == "full":
            if not blocks:
                raise BadInput("the plan checkpoints activations per block, but this model has no repeated blocks")
            checkpoint_blocks([block for _, block in blocks])
        if self.config.compile:
            for _, block in blocks or [("", model)]:
                block.compile()
        if self.world_size == 1:
            return model
        if strategy.sharding in ("ddp", "zero1"):
            return self._ddp(model)
        return self._fully_shard(model, [block for _, block in blocks])

    def _ddp(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=[self.local_rank] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.config.ddp_bucket_cap_mb,
            static_graph=self.config.ddp_static_graph,
            gradient_as_bucket_view=True,
        )
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hook = self.config.comm_hook
        state: Any = None
        reduce: Callable[[Any, dist.GradBucket], torch.futures.Future] = default_hooks.allreduce_hook
        if hook in ("fp16", "bf16"):
            reduce = default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=self.config.powersgd_rank)
            reduce = powerSGD_hook.powerSGD_hook

        def timed(state, bucket):  # unannotated: DDP checks annotations as objects, and ours are strings
            # called as each bucket's gradients are ready; the last call marks where the backward's compute
            # ended, so what the backward then still waits is communication left exposed
            self._last_bucket_ready = self.metrics.mark()
            return reduce(state, bucket)

        ddp.register_comm_hook(state, timed)
        return ddp

    def _fully_shard(self, model: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        strategy = self.config.strategy
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        mesh = None
        if strategy.sharding == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            mesh = init_device_mesh(self.device.type, (self.world_size // per_node, per_node))
        reshard = strategy.sharding != "zero2"
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        return model

    def _build_optimizer(self, optimizer: torch.optim.Optimizer | OptimizerFactory) -> torch.optim.Optimizer:
        """The factory's optimizer over the wrapped model's parameters. A ready optimizer is kept where its
        parameters are still the model's (one rank, DDP); under FSDP2 and ZeRO-1 it is rebuilt from its
        class and settings, which needs a single parameter group."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        sharded = self.world_size > 1 and self.config.strategy.sharding != "ddp"
        if isinstance(optimizer, torch.optim.Optimizer) and not sharded:
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if owned != {id(p) for p in params}:
                raise BadInput("the optimizer does not hold exactly the model's trainable parameters")
            fuse_adam(optimizer)
            return optimizer
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            factory = optimizer
        else:
            if len(optimizer.param_groups) > 1:
                raise BadInput(
                    "the optimizer has several parameter groups; pass a factory instead: "
                    "prepare(model, lambda params: MyOptimizer(...), loader)"
                )
            # the group's current settings: a scheduler or the user may have changed lr after construction
            cls = type(optimizer)
            settings = constructor_settings(cls, optimizer.param_groups[0])

            def factory(ps: Any) -> torch.optim.Optimizer:
                return cls(ps, **settings)

        if self.world_size > 1 and self.config.strategy.sharding == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            built = factory(params)
            if len(built.param_groups) > 1:
                raise BadInput("ZeRO-1 takes one parameter group: the optimizer factory made several")
            fuse_adam(built)  # ZeRO-1 copies its groups' settings into its shard's optimizer at every step
            settings = constructor_settings(type(built), built.param_groups[0])
            return ZeroRedundancyOptimizer(params, optimizer_class=type(built), **settings)
        built = factory(params)
        fuse_adam(built)
        return built

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
        """The user's DataLoader, rebuilt with the plan's per-rank batch and a DistributedSampler."""
        from torch.utils.data import DataLoader, RandomSampler

        shuffle = isinstance(loader.sampler, RandomSampler)
        # every step takes the plan's global batch: a short last batch is dropped (as Megatron does), so
        # accumulation and the loss scaling stay exact
        sampler = _ResumableSampler(
            loader.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=self.config.seed
        )
        workers = self.config.num_workers if self.config.num_workers is not None else loader.num_workers
        settings: dict[str, Any] = {
            "batch_size": self.config.per_rank_batch,
            "sampler": sampler,
            "num_workers": workers,
            "collate_fn": loader.collate_fn,
            "drop_last": True,
            # seeded per epoch (micro_batches): worker seeds come from it, not from the global RNG, so
            # making an iterator does not shift the model's random stream and a resumed run sees the same
            "generator": torch.Generator(),
            "pin_memory": self.config.pin_memory if self.config.pin_memory is not None else loader.pin_memory,
        }
        if workers > 0:
            settings["persistent_workers"] = (
                self.config.persistent_workers
                if self.config.persistent_workers is not None
                else loader.persistent_workers
            )
            settings["prefetch_factor"] = self.config.prefetch_factor or loader.prefetch_factor
        if loader.batch_size not in (None, self.config.per_rank_batch) and self.rank == 0:
            log.info(
                "loader batch size %s replaced by the plan's per-rank batch %s (micro-batch %s x accumulation %s)",
                loader.batch_size,
                self.config.per_rank_batch,
                self.micro_batch,
                self.accumulation,
            )
        return DataLoader(loader.dataset, **settings)

    # ------------------------------------------------------------------------------------------ the loop

    def micro_batches(self, epochs: int = 1) -> Iterator[Any]:
        """Micro-batches on the device, ``accumulation`` per optimizer step, for ``epochs`` epochs (counted
        from the start of the run, so a resumed run finishes the same epochs)."""
        try:
            while self.epoch < epochs:
                self.loader.sampler.set_epoch(self.epoch)
                # per epoch and rank: workers on different ranks must not draw the same augmentations
                self.loader.generator.manual_seed(self.config.seed + 1_000_003 * self.epoch + self.rank)
                # resumed mid-epoch: the sampler starts after what the checkpoint already trained on, so those
                # samples are not loaded again (the order is the same; with DataLoader workers, per-worker
                # random augmentations draw differently from an uninterrupted run)
                self.loader.sampler.skip = self.batch_in_epoch * self.loader.batch_size
                batches = iter(self.loader)
                while True:
                    with self.metrics.data_wait():
                        batch = next(batches, None)
                    if batch is None:
                        break
                    batch = _to_device(batch, self.device)
                    while True:  # replays the batch, split finer, after an agreed out-of-memory
                        self._retry = False
                        for index, micro in enumerate(_split(batch, self.accumulation)):
                            self._micro_index = index
                            yield micro
                            if self._retry:
                                break
                        if not self._retry:
                            break
                    self.batch_in_epoch += 1
                    if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
                        self.save_checkpoint()
                self.epoch += 1
                self.batch_in_epoch = 0
        except GeneratorExit:  # the loop stopped early: a break (every rank alike), or an error in its body
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
        boundary = self._micro_index == self.accumulation - 1
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
                if self.world_size > 1 and (boundary or self.config.strategy.sharding != "ddp"):
                    # the other ranks are inside a gradient collective (DDP's sync step, FSDP2's gathers and
                    # reduce-scatters): no agreement is possible, so end here and come back smaller
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
        self._loss_sum = self._loss_sum + loss.detach()  # a tensor: reading it would sync the GPU every micro-batch
        self._last_bucket_ready = None
        with torch.autocast(self.device.type, enabled=False):
            self.scaler.scale(loss / self.accumulation).backward()
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
        self.step += 1
        self.metrics.end_step(
            samples=self.micro_batch * self.accumulation,
            loss=self._loss_sum / self.accumulation,
            micro_batch=self.micro_batch,
            accumulation=self.accumulation,
            skipped=skipped,
        )
        self._loss_sum = 0.0

    # ----------------------------------------------------------------------------------- out of memory

    def _any_rank(self, flag: bool) -> bool:
        """Whether any rank hit out-of-memory in this micro-batch: every rank asks, so all decide alike."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _smaller_micro_batch(self) -> tuple[int, int]:
        """(micro-batch, accumulation): the largest micro-batch at most half the current one that still divides
        the per-rank batch, and the accumulation that makes it up (so the result stays the same)."""
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
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
        }

    def _resume(self) -> None:
        if self.checkpointer is None:
            return
        restored = self.checkpointer.load_latest(
            model=self.model, optimizer=self.optimizer, scaler=self.scaler, scheduler=self.scheduler
        )
        if restored is not None:
            _, extra = restored
            self.step = int(extra["step"])
            self.epoch = int(extra["epoch"])
            self.batch_in_epoch = int(extra["batch_in_epoch"])
            self.micro_batch = int(extra["micro_batch"])
            self.accumulation = int(extra["accumulation"])
            if self.rank == 0:
                log.warning("resumed from step %d (epoch %d, batch %d)", self.step, self.epoch, self.batch_in_epoch)
            self._flag_unfused_adam("as the checkpoint had it")  # a restore brings back the saved groups' settings
        recorded = self.checkpointer.recorded_micro_batch()
        if recorded is not None:
            micro, accumulation = recorded
            if micro < self.micro_batch and micro * accumulation == self.micro_batch * self.accumulation:
                self.micro_batch, self.accumulation = micro, accumulation
                self.oom_events.append({"step": self.step, "micro_batch": micro, "accumulation": accumulation})
                if self.rank == 0:
                    log.warning(
                        "micro-batch %d x %d accumulation, as recorded after an out-of-memory in a gradient collective",
                        micro,
                        accumulation,
                    )

    def close(self, *, checkpoint: bool = True) -> None:
        """End of training: a last checkpoint, the metrics summary against the plan."""
        if checkpoint and self.checkpointer is not None and self.checkpointer.latest_step() != self.step:
            self.save_checkpoint()
        self.summary = self.metrics.summary(self.config.predicted)
        self.metrics.close(self.config.predicted)


# ----------------------------------------------------------------------------------------------- helpers


class _ResumableSampler(torch.utils.data.DistributedSampler):
    """A DistributedSampler that starts its epoch ``skip`` indices in (Megatron's consumed-samples idea), so a
    run resumed mid-epoch does not load and throw away the batches it already trained on."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


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


def constructor_settings(cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings that ``cls`` takes as arguments: a group holds more (its parameters, a
    scheduler's ``initial_lr``, AdamW's ``decoupled_weight_decay``, which AdamW's constructor refuses). A
    constructor taking ``**kwargs`` passes them on: its base class's arguments count too."""
    accepted: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        accepted |= {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if all(p.kind is not p.VAR_KEYWORD for p in parameters):
            break
    return {key: value for key, value in group.items() if key in accepted and key != "params"}


def fuse_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Make an Adam or AdamW step fused (``fused=True``) where its maker left the choice to PyTorch (neither
    ``fused`` nor ``foreach`` given) and it has not stepped yet, on GPUs and CPUs: one kernel over all parameters
    and no parameter-sized temporary, as the plan assumes (PyTorch's default on a GPU, foreach, holds the square
    roots of the second moments, 4 bytes a parameter). Subclasses, whose step may differ, are left alone. Under
    fp16 GradScaler unscales the gradients itself, as for any optimizer. True if it did."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return False
    params = [p for g in groups for p in g["params"]]
    if not all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params):
        return False
    for group in groups:
        group["fused"] = True
    return True


def unfused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Adam or AdamW (also inside ZeRO-1) whose step is not fused: PyTorch's default on a GPU is ``foreach``,
    whose step makes a temporary of every parameter's size (the square roots of the second moments)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the local optimizer here
    adam = isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
    return adam and not all(group.get("fused") for group in inner.param_groups)


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Full activation checkpointing: each block keeps its input and recomputes the rest in the backward
    (non-reentrant ``torch.utils.checkpoint``). A Hugging Face model must also run without its KV cache
    (``workload.trace.without_kv_cache``), or each recomputation appends its keys and values again."""
    for block in blocks:
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    return batch


def _split(batch: Any, parts: int) -> list[Any]:
    """``parts`` micro-batches along the first dimension of every tensor in the batch."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise BadInput(f"a batch of {batch.shape[0]} samples does not split into {parts} micro-batches")
        return list(batch.chunk(parts))
    if isinstance(batch, tuple | list):
        columns = [_split(item, parts) for item in batch]
        return [type(batch)(column[i] for column in columns) for i in range(parts)]
    if isinstance(batch, dict):
        columns = {key: _split(value, parts) for key, value in batch.items()}
        return [{key: column[i] for key, column in columns.items()} for i in range(parts)]
    return [batch] * parts


def _parse_oom_hook(text: str | None) -> tuple[int, int, int] | None:
    """``STEP:RANK[:MICRO]`` (micro-batch index within the step, 0 by default); ignored in a restart."""
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    step, rank, micro, *_ = [*text.split(":"), "0", "0"]
    return int(step), int(rank or 0), int(micro or 0)
