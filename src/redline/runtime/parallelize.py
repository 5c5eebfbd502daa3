"""The steps ``prepare()`` applies to the model and its optimizer, one free function each, in the order it calls
them (torchtitan's ``parallelize_*`` shape): ``apply_numerics``, ``apply_sync_batchnorm``, ``apply_fp8``
(``fp8.py``), ``apply_tp`` (``tensor_parallel.py``), ``apply_activation_checkpointing``, ``apply_compile``,
then ``apply_ddp`` or ``apply_fsdp``, then ``build_optimizer`` (with ``apply_zero1`` for ZeRO-1). Each takes the
model and the settings it needs, and none holds state: each can be called and tested on its own.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any, NoReturn, get_type_hints

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint, noop_context_fn

from redline.errors import BadInput, one_line
from redline.plan.strategy import Strategy
from redline.runtime.config import DdpConfig, NumericsConfig
from redline.runtime.tensor_parallel import average_gradients, fsdp_layout
from redline.runtime.whole_model import DDP_SAVE_INSTEAD
from redline.workload.selective import selective_checkpoint_context

log = logging.getLogger("redline.runtime")

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

# the 16-bit type a plan's precision computes in outside its matmuls (autocast, FSDP2's parameters); fp8 recipes
# run everything but their float8 linear layers in bf16 (torchtitan's); fp32 has none
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast and FSDP2's mixed precision use under ``precision``; None for fp32."""
    return _COMPUTE_DTYPES.get(precision)


def apply_numerics(config: NumericsConfig, device: torch.device) -> None:
    """TF32 and ``cudnn.benchmark`` on GPUs, and the CPU operators' threads, as the config asks."""
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = config.tf32
        torch.backends.cudnn.allow_tf32 = config.tf32
        torch.backends.cudnn.benchmark = config.cudnn_benchmark


def apply_sync_batchnorm(model: nn.Module, *, enabled: bool, device: torch.device, rank: int) -> None:
    """BatchNorm over several ranks normalises each rank's share of the batch by its own statistics: not
    what one process computes (a small CNN's weights differed by 0.17 after a few steps). Its layers become
    SyncBatchNorm on GPUs and CrossRankBatchNorm on CPUs (PyTorch's is GPU-only): statistics over the global
    batch. ``enabled=False`` keeps them per rank, said. The layers then run collectives in every forward and
    backward (``syncs_batchnorm``)."""
    count = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not count:
        return
    if enabled and device.type == "cuda":
        sync_batchnorm(model)
        note = "%d BatchNorm layers made SyncBatchNorm: statistics over the global batch, as one process has"
    elif enabled:
        from redline.runtime.batchnorm import cross_rank_batchnorm

        cross_rank_batchnorm(model)
        note = "%d BatchNorm layers normalise over the global batch (CrossRankBatchNorm: SyncBatchNorm is GPU-only)"
    else:
        note = "sync_batchnorm=False: %d BatchNorm layers normalise over each rank's share of the batch"
    if rank == 0:
        log.warning(note, count)


def syncs_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm layers that ``apply_sync_batchnorm`` made synchronise over the ranks:
    they run collectives in every forward and backward."""
    from redline.runtime.batchnorm import CrossRankBatchNorm

    return any(isinstance(m, nn.SyncBatchNorm | CrossRankBatchNorm) for m in model.modules())


def sync_batchnorm(model: nn.Module) -> None:
    """Every BatchNorm layer of ``model`` made SyncBatchNorm in place (its weights and statistics kept)."""
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if converted is not model:  # the model itself was a BatchNorm layer: nothing to hold the new one
        raise BadInput("the model is a single BatchNorm layer: wrap it in a module")


def apply_activation_checkpointing(blocks: list[nn.Module], strategy: Strategy) -> None:
    """The plan's activation checkpointing (``none``, ``selective``, ``full``) over every
    ``checkpoint_every``-th of the model's repeated blocks (the k-th, the 2k-th...), as the planner counts it."""
    if strategy.checkpointing == "none":
        return
    if not blocks:
        raise BadInput("the plan checkpoints activations per block, but this model has no repeated blocks")
    every = strategy.checkpoint_every
    if every > len(blocks):
        raise BadInput(
            f"ac_every {every} is more than the model's {len(blocks)} repeated blocks: none would be checkpointed"
        )
    checkpoint_blocks(blocks[every - 1 :: every], selective=strategy.checkpointing == "selective")


def checkpoint_blocks(blocks: list[nn.Module], *, selective: bool = False) -> None:
    """Activation checkpointing of each block (non-reentrant ``torch.utils.checkpoint``): full, each block keeps
    its input and recomputes the rest in the backward; selective, it also keeps the outputs of the matmuls and
    fused attention kernels (``workload.selective.SAVED_OPS``, the same policy the planner measures) and
    recomputes the rest. The random ops recompute as they ran: the checkpoint restores the RNG state. A Hugging
    Face model must also run without its KV cache (``workload.structure.without_kv_cache``), or each
    recomputation appends its keys and values again. Each block's ``forward`` becomes a ``CheckpointedForward``
    of the block."""
    for block in blocks:
        block.forward = CheckpointedForward(block, selective=selective)


class CheckpointedForward:
    """A checkpointed block's ``forward``: its class's forward, run under ``torch.utils.checkpoint``.

    It holds the block itself and looks its forward up at each call, where a closure over the block's bound
    ``forward`` would hold the block it was made for: ``copy.deepcopy`` of the model (an EMA, a teacher) maps
    the block to its copy, so the copy's forward computes with the copy's weights, and ``torch.save`` pickles
    it as the block and a flag (a closure does not pickle)."""

    def __init__(self, block: nn.Module, *, selective: bool) -> None:
        self.block = block
        self.selective = selective  # also keep the matmuls' outputs (selective_checkpoint_context)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the context functions make, at each forward, the pair of contexts that hold what it saved for its backward
        context_fn = selective_checkpoint_context if self.selective else noop_context_fn
        forward = functools.partial(type(self.block).forward, self.block)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    def __repr__(self) -> str:
        kind = "selective" if self.selective else "full"
        return f"CheckpointedForward({type(self.block).__name__}, {kind})"


def apply_compile(model: nn.Module, blocks: list[nn.Module]) -> None:
    """``torch.compile`` of each repeated block (one graph compiled once, reused), else the whole model."""
    for block in blocks or [model]:
        block.compile()


def apply_ddp(
    model: nn.Module, config: DdpConfig, *, device: torch.device, local_rank: int, on_bucket_ready: Callable[[], None]
) -> nn.Module:
    """DDP with the config's bucket size, static graph and gradient compression hook; gradients are views of
    the buckets. ``on_bucket_ready`` is called as each bucket's gradients are ready: the last call marks where
    the backward's compute ended, so what it then still waits is communication left exposed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model,
        device_ids=[local_rank] if device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        static_graph=config.static_graph,
        gradient_as_bucket_view=True,
    )
    hook = config.comm_hook
    state: Any = None
    reduce: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]] = default_hooks.allreduce_hook
    if hook in ("fp16", "bf16"):
        reduce = default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=config.powersgd_rank)
        reduce = powerSGD_hook.powerSGD_hook

    ddp.register_comm_hook(state, TimedCommHook(reduce, on_bucket_ready))
    return ddp


class TimedCommHook:
    """``apply_ddp``'s comm hook: ``on_bucket_ready()``, then the gradient reduction ``reduce``.

    An object rather than a closure so that pickling the DDP wrapper (``torch.save(run.model)``) ends in one line
    saying what to save instead: the wrapper belongs to this run's process group, the model it wraps
    (``run.model.module``) pickles. A copy of the wrapper shares the hook, as it shared the closure."""

    def __init__(
        self,
        reduce: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
        on_bucket_ready: Callable[[], None],
    ) -> None:
        self.reduce = reduce
        self.on_bucket_ready = on_bucket_ready
        self.__name__ = self.__qualname__ = "timed_comm_hook"  # DDP reads a hook's names (logs, its bf16 check)

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.on_bucket_ready()
        return self.reduce(state, bucket)

    def __reduce__(self) -> NoReturn:
        raise pickle.PicklingError(DDP_SAVE_INSTEAD)

    def __copy__(self) -> TimedCommHook:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TimedCommHook:
        return self  # a deep copy would copy the run its on_bucket_ready is bound to


# DDP compares the hook's annotations with the classes themselves, and this module's are strings until resolved
TimedCommHook.__call__.__annotations__ = get_type_hints(TimedCommHook.__call__)


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    strategy: Strategy,
    *,
    device: torch.device,
    world: int,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2 ``fully_shard`` per block, then the root: parameters in the plan's 16-bit precision with fp32
    reductions; ZeRO-2 keeps the parameters gathered after the forward, FSDP reshards them; HSDP shards within
    a node and replicates across nodes. ``mesh``: the data-parallel ranks to shard over (beside tensor
    parallelism), instead of all of them; DDP and ZeRO-1 plans shard there as ZeRO-2 does (DDP takes no
    DTensor parameters), each rank holding its share of the parameters, gradients and optimizer states.
    There a packed projection's packed dimension is not cut again (``fsdp_layout``): its weight is sharded
    along its other dimension, a 1-D packed bias left out of FSDP2, its gradient averaged by a hook."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = autocast_dtype(strategy.precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    if mesh is None and strategy.sharding == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    reshard = strategy.sharding not in ("zero2", "ddp", "zero1")
    place: Callable[[nn.Parameter], Shard | None] | None = None
    ignored: set[nn.Parameter] = set()
    if mesh is not None and mesh.ndim == 1:  # beside tensor parallelism: packed projections' packed dimension
        # is not cut again (fsdp_layout)
        place, ignored = fsdp_layout(model, mesh)
        average_gradients(ignored, mesh)
    for module in (*blocks, model):  # each block, then the root
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard,
            shard_placement_fn=place,
            ignored_params=ignored,
        )
    return model


def build_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory, *, world: int, sharding: str
) -> torch.optim.Optimizer:
    """The factory's optimizer over the wrapped model's parameters. A ready optimizer is kept where its
    parameters are still the model's (one rank, DDP); under FSDP2 and ZeRO-1 it is rebuilt from its
    class and settings, which needs a single parameter group."""
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = world > 1 and sharding != "ddp"
    if isinstance(optimizer, torch.optim.Optimizer) and not sharded:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if owned != {id(p) for p in params}:
            raise BadInput("the optimizer does not hold exactly the model's trainable parameters")
        fuse_adam(optimizer)
        return optimizer
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        factory = _explained(optimizer)
    else:
        if len(optimizer.param_groups) > 1:
            raise BadInput(
                "the optimizer has several parameter groups; pass a factory instead, which receives the flat "
                "list of the wrapped model's trainable parameters: prepare(model, lambda params: "
                "MyOptimizer(params, ...), loader)"
            )
        # the group's current settings: a scheduler or the user may have changed lr after construction
        cls = type(optimizer)
        settings = constructor_settings(cls, optimizer.param_groups[0])

        def factory(ps: Any) -> torch.optim.Optimizer:
            return cls(ps, **settings)

    if world > 1 and sharding == "zero1":
        return apply_zero1(params, factory)
    built = factory(params)
    fuse_adam(built)
    return built


def apply_zero1(params: list[nn.Parameter], factory: OptimizerFactory) -> torch.optim.Optimizer:
    """ZeRO-1: ``ZeroRedundancyOptimizer`` over the factory's optimizer class and settings, each rank holding
    the optimizer state of its shard of the parameters (the gradients are DDP's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    built = factory(params)
    if len(built.param_groups) > 1:
        raise BadInput("ZeRO-1 takes one parameter group: the optimizer factory made several")
    fuse_adam(built)  # ZeRO-1 copies its groups' settings into its shard's optimizer at every step
    settings = constructor_settings(type(built), built.param_groups[0])
    return ZeroRedundancyOptimizer(params, optimizer_class=type(built), **settings)


def _explained(factory: OptimizerFactory) -> OptimizerFactory:
    """The user's optimizer factory, its failure on what it is given said as such: it receives a flat list of
    parameters (FSDP2's sharded ones), not the model or named groups."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        try:
            return factory(params)
        except (TypeError, AttributeError, ValueError) as exc:
            raise BadInput(
                f"the optimizer factory failed ({one_line(exc)}); it receives a flat list of the "
                "wrapped model's trainable parameters (sharded DTensors under FSDP2), not the model or named "
                "groups: prepare(model, lambda params: AdamW(params, lr=...), loader)"
            ) from exc

    return build


def constructor_settings(cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings that ``cls`` takes as arguments: a group holds more (its parameters, a
    scheduler's ``initial_lr``, AdamW's ``decoupled_weight_decay``, which AdamW's constructor refuses). A
    constructor taking ``**kwargs`` passes them on: its base class's arguments count too."""
    accepted: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
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
