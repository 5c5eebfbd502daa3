"""The steps ``prepare()`` applies to the model and its optimizer, one free function each, in the order it calls
them (torchtitan's ``parallelize_*`` shape): ``apply_numerics``, ``apply_same_start``, ``apply_sync_batchnorm``,
``apply_fp8`` (``fp8.py``), ``apply_tp`` (``tensor_parallel.py``), ``apply_activation_checkpointing``,
``apply_compile``, then ``apply_ddp`` or ``apply_fsdp``, then ``build_optimizer`` (with ``apply_zero1`` for
ZeRO-1). Each takes the model and the settings it needs, and none holds state: each can be called and tested on
its own.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import pickle
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, get_type_hints

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint, noop_context_fn

from redline.errors import BadInput, one_line
from redline.plan.strategy import Strategy
from redline.runtime.config import DdpConfig, NumericsConfig, RunConfig
from redline.runtime.distributed import agree, same_on_every_rank
from redline.runtime.mesh import RunMesh
from redline.runtime.pipeline import LossFn, Pipeline, RankModel, find_layout, split, tied_group, tied_names
from redline.runtime.tensor_parallel import average_gradients, fsdp_layout
from redline.runtime.whole_model import DDP_SAVE_INSTEAD
from redline.workload.selective import selective_checkpoint_context

log = logging.getLogger("redline.runtime")

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

# the 16-bit type a plan's precision computes in outside its matmuls (autocast, FSDP2's parameters); fp8 recipes
# run everything but their float8 linear layers in bf16 (torchtitan's); fp32 has none
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
# apply_same_start's bucket: few enough collectives for a large model, and a temporary small beside it
BROADCAST_BUCKET_BYTES = 64 * 2**20


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


def apply_same_start(model: nn.Module, *, rank: int, world: int, device: torch.device) -> None:
    """Every rank's parameters and buffers made rank 0's, before anything shards or splits them. A script that
    seeds each rank differently (``torch.manual_seed(1337 + rank)``, as nanoGPT does) builds other weights on
    each rank: DDP would replace them by rank 0's as it starts, but FSDP2, tensor and pipeline parallelism cut
    each rank's share from the weights that rank built, and the ranks would train a patchwork of several models.
    Said once, on rank 0, when some rank's weights differed. Rank 0's bytes go out in buckets of
    ``BROADCAST_BUCKET_BYTES`` (any dtype: a bucket is bytes; a tensor larger than a bucket in pieces), so the
    temporary memory stays one bucket whatever the model's size. Left as they are: meta tensors (no values yet)
    and DTensors (already laid out by whoever made them). The ranks must have built the same shapes: checked
    first, in one small all-reduce, and refused in one line otherwise."""
    if world == 1:
        return
    tensors = [
        tensor.detach()
        for tensor in (*model.parameters(), *model.buffers())
        if tensor.numel() and not tensor.is_meta and tensor.layout == torch.strided and not isinstance(tensor, DTensor)
    ]
    _check_same_shapes(tensors, device)
    # a strided tensor (a transposed weight, channels_last) has no flat view: its bytes go through a dense copy
    staged = [(tensor, tensor.contiguous()) for tensor in tensors if not tensor.is_contiguous()]
    dense = [tensor for tensor in tensors if tensor.is_contiguous()] + [copy for _, copy in staged]
    differed = False
    with torch.no_grad():
        for bucket in _byte_buckets(dense, BROADCAST_BUCKET_BYTES):
            differed = _broadcast_from_rank0(bucket, rank=rank) or differed
        for tensor, copy in staged:
            tensor.copy_(copy)
    if agree(differed, dist.ReduceOp.MAX, world=world, device=device) and rank == 0:
        log.warning(
            "the ranks built different weights (a seed per rank?): each starts from rank 0's instead, so that "
            "they train one model"
        )


def _check_same_shapes(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Every rank holds the same shapes and dtypes in the same order (a CRC of them compared in one all-reduce):
    bytes broadcast into another model's tensors would fill them with garbage, or hang."""
    layout = repr([(tuple(tensor.shape), str(tensor.dtype)) for tensor in tensors]).encode()
    if not same_on_every_rank(zlib.crc32(layout), device=device):
        raise BadInput(
            "the ranks built models of different shapes: every rank must build the same model (its weights may "
            "differ; rank 0's are broadcast)"
        )


def _byte_buckets(tensors: list[torch.Tensor], limit_bytes: int) -> Iterator[list[torch.Tensor]]:
    """The contiguous ``tensors``' bytes as flat uint8 views (writing into one writes its tensor), grouped into
    buckets of at most ``limit_bytes`` on one device; a tensor larger than that is cut into pieces."""
    bucket: list[torch.Tensor] = []
    size_bytes = 0
    for tensor in tensors:
        for piece in tensor.reshape(-1).view(torch.uint8).split(limit_bytes):
            if bucket and (size_bytes + piece.numel() > limit_bytes or piece.device != bucket[0].device):
                yield bucket
                bucket, size_bytes = [], 0
            bucket.append(piece)
            size_bytes += piece.numel()
    if bucket:
        yield bucket


def _broadcast_from_rank0(pieces: list[torch.Tensor], *, rank: int) -> bool:
    """Rank 0's bytes written into every rank's ``pieces`` in one broadcast; whether this rank's differed."""
    if rank == 0:
        dist.broadcast(torch.cat(pieces), src=0)
        return False
    received = torch.empty(sum(piece.numel() for piece in pieces), dtype=torch.uint8, device=pieces[0].device)
    dist.broadcast(received, src=0)
    differed = False
    for piece, theirs in zip(pieces, received.split([piece.numel() for piece in pieces]), strict=True):
        differed = differed or not torch.equal(piece, theirs)  # bytes: a NaN equals itself
        piece.copy_(theirs)
    return differed


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


class Trainable(list[nn.Parameter]):
    """The wrapped model's trainable parameters in the model's order: what an optimizer factory receives
    (``prepare(model, lambda params: AdamW(params, lr=...), loader)``). Under FSDP2 and tensor parallelism they
    are sharded DTensors, whose ``shape`` and ``dim()`` are the whole parameter's, so groups split by dimension
    come out as on the model itself. ``named`` pairs each with its module path in the model as you built it (no
    wrapper's prefix), for groups split by name::

        def adamw(params):
            decay = [p for name, p in params.named if not name.endswith("bias") and "norm" not in name]
            rest = [p for name, p in params.named if name.endswith("bias") or "norm" in name]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=3e-4)
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(parameter for _, parameter in named)
        self.named = named


def trainable(model: nn.Module) -> Trainable:
    """The wrapped ``model``'s trainable parameters by their module paths in the model as the user built it:
    DDP's ``module.`` left out; FSDP2, tensor parallelism, fp8 and per-block ``torch.compile`` keep the paths,
    and a pipeline rank's ``RankModel`` holds its stages' parameters under them."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return Trainable([(path, parameter) for path, parameter in inner.named_parameters() if parameter.requires_grad])


@dataclass(frozen=True)
class ReadyOptimizer:
    """An optimizer the user built, each of its groups' parameters known by its module paths in the model. Taken
    before the model is wrapped: FSDP2 and tensor parallelism replace the parameters by DTensor ones under the
    same paths, and ``rebuild`` makes the optimizer again over those, group by group, as torch's own
    ``fully_shard`` recipe does (the optimizer built after sharding)."""

    optimizer: torch.optim.Optimizer
    paths: list[list[list[str]]]  # per group, per parameter: its paths in the model (several for a shared one)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: nn.Module) -> ReadyOptimizer:
        """``optimizer`` over ``model``, which it must hold exactly the trainable parameters of (refused in
        one line otherwise: an optimizer over another copy of the model would step nothing of this one)."""
        paths: dict[int, list[str]] = {}
        for path, parameter in model.named_parameters(remove_duplicate=False):
            paths.setdefault(id(parameter), []).append(path)
        owned = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        if owned != {id(parameter) for parameter in model.parameters() if parameter.requires_grad}:
            raise BadInput("the optimizer does not hold exactly the model's trainable parameters")
        return cls(optimizer, [[paths[id(p)] for p in group["params"]] for group in optimizer.param_groups])

    def holds(self, params: list[nn.Parameter]) -> bool:
        """Whether the optimizer steps exactly ``params`` (the wrapped model's kept the user's: one rank, DDP)."""
        owned = {id(parameter) for group in self.optimizer.param_groups for parameter in group["params"]}
        return owned == {id(parameter) for parameter in params}

    def rebuild(self, params: Trainable) -> torch.optim.Optimizer:
        """The optimizer's class over the wrapped model's ``params``: each group holds those at its parameters'
        paths (on a pipeline rank, those of its stages: a group may be empty there, kept so that the groups line
        up with a scheduler's per-group settings), with every setting the group has now (a scheduler or the user
        may have changed ``lr`` since construction). ``param_names`` (an optimizer built over named parameters)
        is left out: ZeRO-1 shares each group's parameters out and keeps no names in line with them."""
        groups = []
        for group, found in zip(self.optimizer.param_groups, self._found(params), strict=True):
            settings = {key: value for key, value in group.items() if key not in ("params", "param_names")}
            groups.append(settings | {"params": [parameter for _, parameter in found]})
        cls = type(self.optimizer)
        return cls(groups, **constructor_settings(cls, self.optimizer.defaults))

    def repoint(self, params: Trainable) -> torch.optim.Optimizer:
        """The user's optimizer itself, each group's parameters replaced by the wrapped model's at their paths
        (as ``rebuild`` finds them), every setting left as it is: the object the script holds, and a scheduler
        made on it, step the sharded model (accelerate re-points an optimizer prepared for FSDP likewise). For
        an optimizer without state only: its state is keyed by the tensors it held."""
        for group, found in zip(self.optimizer.param_groups, self._found(params), strict=True):
            group["params"] = [parameter for _, parameter in found]
            if "param_names" in group:
                group["param_names"] = [path for path, _ in found]
        return self.optimizer

    def repointable(self) -> bool:
        """Whether ``repoint`` may keep the optimizer: one without state (its state is keyed by the tensors it
        held) whose parameters are its groups' (a ZeroRedundancyOptimizer keeps its own lists beside them)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return not self.optimizer.state and not isinstance(self.optimizer, ZeroRedundancyOptimizer)

    def _found(self, params: Trainable) -> list[list[tuple[str, nn.Parameter]]]:
        """Per group, the wrapped model's parameters (with their paths) at its parameters' paths: on a pipeline
        rank those of its stages only, so a group may be empty there."""
        held = dict(params.named)
        groups = [
            [next(((path, held[path]) for path in names if path in held), None) for names in paths]
            for paths in self.paths
        ]
        found = [[pair for pair in group if pair is not None] for group in groups]
        if sum(map(len, found)) != len(params):  # a wrapper that renamed the modules
            raise RuntimeError("the wrapped model's parameters are not all at their module paths in the model")
        return found


def build_optimizer(
    model: nn.Module, optimizer: ReadyOptimizer | OptimizerFactory, *, world: int, sharding: str
) -> torch.optim.Optimizer:
    """The optimizer over the wrapped model's trainable parameters. A ready optimizer is kept where they are
    still the ones it holds (one rank, DDP); where sharding replaced them (FSDP2, tensor or pipeline
    parallelism) it is kept too, its groups re-pointed at the new ones (``ReadyOptimizer.repoint``), so that
    the script's ``optimizer`` and a scheduler made on it go on; where it has state already (keyed by the old
    tensors), or ZeRO-1 shares its state out, it is rebuilt from its class, each of its parameter groups with
    its settings (``ReadyOptimizer.rebuild``). A factory receives the parameters as ``Trainable`` (with
    their names) and may make several groups. Under ZeRO-1 the optimizer's class and groups make a
    ``ZeroRedundancyOptimizer`` (``apply_zero1``)."""
    params = trainable(model)
    zero1 = world > 1 and sharding == "zero1"
    if isinstance(optimizer, ReadyOptimizer) and not zero1 and optimizer.holds(params):
        fuse_adam(optimizer.optimizer)
        return optimizer.optimizer
    if isinstance(optimizer, ReadyOptimizer) and not zero1 and optimizer.repointable():
        fuse_adam(optimizer.repoint(params))
        return optimizer.optimizer
    factory = optimizer.rebuild if isinstance(optimizer, ReadyOptimizer) else _explained(optimizer)
    if zero1:
        return apply_zero1(params, factory)
    built = factory(params)
    fuse_adam(built)
    return built


def build_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The LR scheduler over ``optimizer``: a ready one must drive it; where the optimizer was rebuilt (ZeRO-1,
    an optimizer with state), a factory (``scheduler=lambda optimizer: ...``) builds it on the new one."""
    if scheduler is None:
        return None
    if not hasattr(scheduler, "step"):
        return scheduler(optimizer)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise BadInput(
            "the optimizer was rebuilt (ZeRO-1, or it had state already), so the scheduler would drive the old one: "
            "pass scheduler=lambda optimizer: YourScheduler(optimizer, ...)"
        )
    return scheduler


def apply_zero1(params: Trainable, factory: OptimizerFactory) -> torch.optim.Optimizer:
    """ZeRO-1: ``ZeroRedundancyOptimizer`` over the factory's optimizer class and parameter groups, each group's
    settings kept, each rank holding the optimizer state of its share of every group's parameters (the
    gradients are DDP's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    built = factory(params)
    fuse_adam(built)  # ZeRO-1 copies its groups' settings into its shard's optimizer at every step
    # ZeRO-1 shares each group's parameters out and keeps no names in line with them: param_names left out
    groups = [{key: value for key, value in group.items() if key != "param_names"} for group in built.param_groups]
    settings = constructor_settings(type(built), built.defaults)
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(built), **settings)


def _explained(factory: OptimizerFactory) -> OptimizerFactory:
    """The user's optimizer factory, its failure on what it is given said as such: it receives the parameters
    (``Trainable``, FSDP2's sharded ones), not the model."""

    def build(params: Trainable) -> torch.optim.Optimizer:
        try:
            return factory(params)
        except (TypeError, AttributeError, ValueError) as exc:
            raise BadInput(
                f"the optimizer factory failed ({one_line(exc)}); it receives a flat list of the "
                "wrapped model's trainable parameters (sharded DTensors under FSDP2; params.named holds them by "
                "module path, for groups split by name), not the model: "
                "prepare(model, lambda params: AdamW(params, lr=...), loader)"
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
    fp16 GradScaler unscales the gradients itself, as for any optimizer. Not where a group mixes DTensors and plain
    tensors. True if it did."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return False
    params = [p for g in groups for p in g["params"]]
    if not all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params):
        return False
    # tensor parallelism alone leaves some layers whole: one group of DTensors and plain tensors, which the fused
    # kernel refuses in one call: left to PyTorch's default step (on the CPU, one parameter at a time)
    if any(len({isinstance(p, DTensor) for p in g["params"]}) > 1 for g in groups):
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


def apply_pipeline(
    model: nn.Module, config: RunConfig, mesh: RunMesh, *, device: torch.device, world: int, loss_fn: LossFn
) -> tuple[Pipeline, nn.Module]:
    """A pipeline-parallel plan: this rank's stages cut from the model (``pipeline.py``), each checkpointed
    and compiled per block as the plan says and sharded by FSDP2 over the data ranks; returns the schedule's
    driver and the model the loop and checkpoints see, the stages' parts under the model's own names
    (``RankModel``)."""
    strategy = config.strategy
    pp_mesh = mesh.pp
    assert pp_mesh is not None, "a pipeline-parallel plan lays its ranks out with a pipeline dimension"
    layout = find_layout(model)
    tied = tied_names(model, layout)
    stages = split(
        model,
        layout,
        pipeline=strategy.pipeline,
        virtual=strategy.virtual_stages,
        pp_rank=pp_mesh.get_local_rank(),
        rank_blocks=config.plan.stage_blocks,
    )
    blocks = [block for stage in stages for block in stage.held_blocks]
    apply_activation_checkpointing(blocks, strategy)
    if config.numerics.compile:
        apply_compile(model, blocks)
    for stage in stages if mesh.dp is not None else ():
        apply_fsdp(stage, list(stage.held_blocks), strategy, device=device, world=world, mesh=mesh.dp)
    pipeline = Pipeline(
        stages,
        schedule=strategy.schedule,
        pp_group=pp_mesh.get_group(),
        device=device,
        loss_fn=loss_fn,
        tied=tied,
        tied_group=tied_group(mesh.world, tied),
    )
    return pipeline, RankModel(stages)
