"""``run.model`` as people use it beside the loop: ``run.model.module``, copies and pickles of it, and the whole
model's state dict under any sharding (``Run.state_dict`` and ``Run.load_state_dict``).

- ``run.model.module`` is the model, as ``DistributedDataParallel.module`` is the model DDP wraps: on one process
  and under FSDP2 or tensor parallelism ``run.model`` is the user's model itself (sharded in place), and its
  ``module`` a second handle on it (``expose_module``). Scripts written for DDP (``model.module.config``,
  ``model.module.save_pretrained``) run unchanged.
- ``copy.deepcopy(run.model)`` (an EMA, a teacher, the best model so far) is a model of its own computing with its
  own weights, and ``torch.save(run.model)`` pickles, on one process: what ``prepare()`` changes on the model's
  instance copies and pickles with it (a forward pre-hook for the KV cache, ``workload.structure``; a
  ``CheckpointedForward`` per checkpointed block, ``parallelize``). Where it cannot (DDP's wrapper belongs to
  the process group; a sharded model's parameters are DTensors over the ranks, its classes made by FSDP2 at
  run time), the pickle or copy ends in one line saying what to save instead (``refuse_copies_when_sharded``,
  and ``parallelize.TimedCommHook`` for DDP).
- ``whole_state_dict`` and ``load_whole_state_dict``: the whole model's state dict, full unsharded tensors on
  the CPU under the model's own names, for ``save_pretrained`` and friends: PyTorch's distributed state-dict
  API (``get_model_state_dict``/``set_model_state_dict`` with ``full_state_dict`` and ``cpu_offload``), which
  gathers FSDP2's and tensor parallelism's DTensors and drops DDP's ``module.`` prefix; pipeline ranks' parts
  gathered to rank 0 beside it.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from redline.runtime.tensor_parallel import join_packed, packed_dim, split_packed

if TYPE_CHECKING:
    from redline.plan.strategy import Strategy

DDP_SAVE_INSTEAD = (
    "run.model is DDP's wrapper, which belongs to this run's process group: save the model it wraps, "
    "torch.save(run.model.module, path), or its weights, torch.save(run.state_dict(), path)"
)
SHARDED_SAVE_INSTEAD = (
    "run.model is sharded over the ranks ({how}): it does not copy or pickle as one model; save the whole model "
    "with torch.save(run.state_dict(), path) (every rank calls run.state_dict(), rank 0 gets it), and keep an "
    "EMA as copies of its parameters, [p.detach().clone() for p in run.model.parameters()]"
)


def expose_module(model: nn.Module) -> None:
    """``model.module``: the model, as DDP's ``module`` is the model it wraps, where ``model`` has no attribute
    of that name already (DDP's wrapper; a model with a submodule ``module``, which its own forward uses).

    It is a second handle on the model, not the model object itself: a module of the same class whose
    ``__dict__`` holds the model's entries, so it shares the model's parameters, buffers, submodules, hooks and
    config (its forward is the model's forward, its ``state_dict()`` the model's), but has no ``module`` of its
    own. A model that was its own ``module`` would send every unwrapping loop (``while hasattr(m, "module")``;
    transformers' ``save_pretrained`` without accelerate) round forever. What is set on the handle as a plain
    attribute stays its own (``training`` of the root module, where ``eval()`` reaches the shared submodules).
    Kept in the model's ``__dict__``, not as a submodule: ``state_dict()``, ``modules()`` and ``parameters()``
    do not see it, and a copy's or an unpickled model's handle shares that model's entries (copy and pickle
    keep shared objects shared)."""
    if hasattr(model, "module"):
        return
    handle = object.__new__(type(model))  # not type(model)(): no __init__ (FSDP2's classes construct on __new__)
    handle.__dict__.update(model.__dict__)
    object.__setattr__(model, "module", handle)  # nn.Module's __setattr__ would register it as a submodule


class _SaveInstead:
    """A sharded model's ``__reduce_ex__`` and ``__deepcopy__``, which pickle and ``copy`` look up on the instance
    before its class: they end in one line saying what to save instead, not in an error about a class FSDP2 made
    at run time (pickle) or FSDP2's refusal to be deep-copied, which names no way out for an EMA."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, *_: object) -> NoReturn:  # pickle passes a protocol, deepcopy its memo
        raise pickle.PicklingError(self.message)


def refuse_copies_when_sharded(model: nn.Module, how: str | None) -> None:
    """Pickling or copying ``model`` says what to save instead, where it is sharded over the ranks (``how``
    says how: FSDP2, tensor or pipeline parallelism; None: it is not, and nothing changes)."""
    if how is not None:
        refuse = _SaveInstead(SHARDED_SAVE_INSTEAD.format(how=how))
        object.__setattr__(model, "__reduce_ex__", refuse)
        object.__setattr__(model, "__deepcopy__", refuse)


def whole_state_dict(model: nn.Module, *, pipeline: bool) -> dict[str, Any]:
    """The whole model's state dict on rank 0, an empty dict on the other ranks: full tensors on the CPU, under
    the model's own names (no DDP ``module.`` prefix, no ``torch.compile`` ``_orig_mod.``). A collective where
    the model is sharded: every rank calls it. Under pipeline parallelism (``pipeline``) each rank holds its
    stages' parts: each gathers its parts whole, and rank 0 gathers the parts of every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    if not pipeline or not distributed:
        # full tensors (gathered from their shards), on the CPU, on rank 0 only (the others get an empty dict)
        return _own_copies(
            model, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        )
    parts = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    parts = _own_copies(
        model, {name: value.cpu() if torch.is_tensor(value) else value for name, value in parts.items()}
    )
    gathered: list[dict[str, Any] | None] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(parts, gathered, dst=0)
    whole: dict[str, Any] = {}
    for rank_parts in gathered or ():
        whole.update(rank_parts or {})  # a tied weight held by two stages is the same on both
    return whole


def load_whole_state_dict(model: nn.Module, state_dict: dict[str, Any], *, pipeline: bool) -> None:
    """Load a whole model's state dict (``whole_state_dict``'s, or a one-process model's ``state_dict()``) into
    ``model`` under any sharding: rank 0's is read (pass an empty dict on the others), each rank taking its
    shard. A collective where the model is sharded. Every key must match (``strict``). ``state_dict`` itself
    is left as it was (the API rewrites the dict it is given: it gets a copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        set_model_state_dict(model, dict(state_dict), options=StateDictOptions(full_state_dict=True))
        return
    if not pipeline:
        rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, dict(state_dict) if dist.get_rank() == 0 else {}, options=rank0)
        _load_packed(model, state_dict, from_rank0=True)
        return
    # each pipeline rank holds other parts: every rank receives the whole dict and takes its parts' entries
    shared = [state_dict if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    held = get_model_state_dict(model).keys()
    parts = {name: value for name, value in (shared[0] or {}).items() if name in held}
    set_model_state_dict(model, dict(parts), options=StateDictOptions(full_state_dict=True))
    _load_packed(model, parts, from_rank0=False)


def how_sharded(strategy: Strategy, *, world: int, sharding: str) -> str | None:
    """How ``run.model`` is sharded over the ranks, in words: pipeline or tensor parallelism, else FSDP2 (the
    run's ``sharding``: zero2, fsdp, hsdp); None where every rank holds it whole (one process, DDP, ZeRO-1)."""
    if strategy.pipeline > 1:
        return "pipeline parallelism: each rank holds its stages"
    if strategy.tensor > 1:
        return "tensor parallelism"
    if world > 1 and sharding not in ("ddp", "zero1"):
        return f"FSDP2, {sharding}"
    return None


def _own_copies(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with a copy of each tensor that is the model's own: moved "to the CPU", a tensor already there
    is handed back as it is (one process, DDP on CPUs), and a state dict kept aside (the best model so far)
    would follow the training. Gathered shards and tensors copied from a GPU are new already."""
    from torch.distributed.tensor import DTensor

    held = {
        tensor.untyped_storage().data_ptr()
        for tensor in model.state_dict().values()
        if torch.is_tensor(tensor) and not isinstance(tensor, DTensor)
    }
    return {
        name: value.clone() if torch.is_tensor(value) and value.untyped_storage().data_ptr() in held else value
        for name, value in state.items()
    }


def _load_packed(model: nn.Module, state_dict: dict[str, Any], *, from_rank0: bool) -> None:
    """Each packed tensor-parallel parameter (GPT-2's ``c_attn``: ``tensor_parallel.packed_dim``) loaded again
    from rank 0's whole one: ``set_model_state_dict`` places a whole tensor by its placements as if each were a
    plain shard, which puts the wrong rows of a packing of q, k and v on a rank. Each rank copies its share of
    each projection into place (``split_packed``'s layout) from the whole tensor: broadcast from rank 0
    (``from_rank0``), else in every rank's ``state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, held in get_model_state_dict(model).items():  # the model's own tensors, sharded
        if not isinstance(held, DTensor) or (found := packed_dim(held)) is None:
            continue  # a packed parameter is a DTensor (tensor parallelism)
        local = held.to_local()
        receives = from_rank0 and dist.get_rank() != 0
        whole = torch.empty(held.shape, dtype=held.dtype) if receives else state_dict[name]
        whole = whole.to(device=local.device, dtype=held.dtype)
        if from_rank0:
            dist.broadcast(whole, src=0)
        dim, packed = found
        parts = [  # each rank cuts its share itself (src_data_rank None: no collective)
            distribute_tensor(projection.contiguous(), part.device_mesh, part.placements, src_data_rank=None)
            for projection, part in zip(whole.chunk(packed, dim=dim), split_packed(held), strict=True)
        ]
        join_packed(held, parts)
