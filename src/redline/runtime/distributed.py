"""The process group a run lives in, and the one-flag agreements its ranks make over it.

``init_distributed`` joins the group torchrun's environment describes (or one already made) and tears down,
at exit, the group it made. ``agree`` is the tiny all-reduce the loop uses wherever every rank must decide
alike: whether some rank ran out of memory, whether every rank still has a batch; ``same_on_every_rank`` the
one that checks the ranks built or drew alike.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time

import torch
import torch.distributed as dist

EXIT_WAIT_S = 5.0  # how long a rank leaving waits for the others at exit (see _destroy_process_group)


def init_distributed() -> tuple[int, int, int]:
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


def agree(flag: bool, op: dist.ReduceOp.RedOpType, *, world: int, device: torch.device) -> bool:
    """One flag reduced over the ranks in a tiny all-reduce (MAX: any rank; MIN: every rank)."""
    if world == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=op)
    return bool(value.item())


def same_on_every_rank(value: int, *, device: torch.device) -> bool:
    """Whether every rank holds the same ``value`` (a fingerprint of what it built or drew): its largest and,
    negated, its smallest over the ranks in one tiny all-reduce."""
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return int(extremes[0]) == -int(extremes[1])


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global 2-norm is at most ``max_norm``; the norm before.

    Under tensor parallelism the gradients are DTensors on more than one mesh (beside FSDP2: the data x tensor
    mesh for most, the data ranks alone for a parameter the tensor plan leaves whole, the tensor ranks for a
    packed bias FSDP2 leaves out), whose norms ``torch.nn.utils.clip_grad_norm_`` cannot stack. Here each
    mesh and layout gets one norm (one collective), made whole, and their squares are summed; with ``group``
    (the pipeline's ranks, each holding other layers) summed over it too."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_layout: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        by_layout.setdefault(key, []).append(grad)
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device if grads else None
    squares = torch.zeros((), device=device)
    for same in by_layout.values():
        norm = torch.nn.utils.get_total_norm(same)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += norm.float() ** 2
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    scale = min(1.0, max_norm / (total.item() + 1e-6))
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return total
