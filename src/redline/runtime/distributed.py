"""The process group a run lives in, and the one-flag agreements its ranks make over it.

``init_distributed`` joins the group torchrun's environment describes (or one already made) and tears down,
at exit, the group it made. ``agree`` is the tiny all-reduce the loop uses wherever every rank must decide
alike: whether some rank ran out of memory, whether every rank still has a batch.
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


def agree(flag: bool, op: dist.ReduceOp, *, world: int, device: torch.device) -> bool:
    """One flag reduced over the ranks in a tiny all-reduce (MAX: any rank; MIN: every rank)."""
    if world == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=op)
    return bool(value.item())
