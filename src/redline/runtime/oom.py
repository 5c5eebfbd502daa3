"""Out of memory inside a micro-batch: a smaller micro-batch, agreed in place or after a restart.

A CUDA OOM inside ``Run.accumulate()`` halves the micro-batch (to the largest divisor of the per-rank batch at
most half of it) and makes up the rest with accumulation, so the per-rank batch, and the result, are unchanged;
the current batch is replayed. With several ranks all agree first (``distributed.agree``), which is only safe
where no gradient collective is in flight (``in_collective``). Elsewhere the rank records the smaller
micro-batch next to the checkpoints and ends (``restart_smaller``); the elastic launcher restarts every rank,
and they resume from the last checkpoint with it (``recorded_micro_batch``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from redline.env import QUEUE_OOM_RECORD, REDLINE_QUEUE_RECORDS, REDLINE_TEST_OOM_AT
from redline.errors import RedlineError

if TYPE_CHECKING:  # the checkpoint module loads torch.distributed.checkpoint: only a run with a directory needs it
    from redline.runtime.checkpoint import Checkpointer

log = logging.getLogger("redline.runtime")


class OutOfMemoryAtMinimum(RedlineError):
    """Even a micro-batch of one sample does not fit."""


class OutOfMemoryDuringCollective(RedlineError):
    """Out of memory where the ranks cannot agree in place; a restart resumes with a smaller micro-batch."""


def in_collective(*, world: int, boundary: bool, sharding: str, batchnorm_synced: bool) -> bool:
    """Whether the other ranks may sit inside a collective when this one runs out of memory (DDP's sync step,
    FSDP2's gathers and reduce-scatters, SyncBatchNorm's statistics in every forward and backward): then no
    agreement is possible."""
    return world > 1 and (boundary or sharding != "ddp" or batchnorm_synced)


def smaller_micro_batch(micro_batch: int, accumulation: int, *, uneven: bool) -> tuple[int, int]:
    """(micro-batch, accumulation): the largest micro-batch at most half the current one that still divides
    the per-rank batch, and the accumulation that makes it up (so the result stays the same). ``uneven``: the
    batches vary in size (a batch sampler's), and each is split in twice as many parts."""
    if uneven:
        if micro_batch == 1:
            raise OutOfMemoryAtMinimum("out of memory with a micro-batch of 1: the plan does not fit this GPU")
        return max(1, micro_batch // 2), accumulation * 2
    per_rank = micro_batch * accumulation
    smaller = next((m for m in range(micro_batch // 2, 0, -1) if per_rank % m == 0), None)
    if smaller is None:
        raise OutOfMemoryAtMinimum("out of memory with a micro-batch of 1: the plan does not fit this GPU")
    return smaller, per_rank // smaller


def free_memory(device: torch.device) -> None:
    """What the failed micro-batch held: its frames and activations, and the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def restart_smaller(
    exc: torch.OutOfMemoryError,
    checkpointer: Checkpointer | None,
    *,
    step: int,
    rank: int,
    smaller: tuple[int, int],
    events: list[dict[str, Any]],
) -> NoReturn:
    """Out of memory where the ranks cannot agree in place: record the ``smaller`` (micro-batch, accumulation)
    next to the checkpoints and end this process. The elastic launcher (``redline run``, torchrun) then restarts
    every rank, and each resumes from the last checkpoint with it (``recorded_micro_batch``)."""
    micro, accumulation = smaller
    where = f"out of memory at step {step} on rank {rank} inside a gradient collective"
    if checkpointer is None:
        raise OutOfMemoryDuringCollective(
            f"{where}: set checkpoint_dir so that a restart resumes with micro-batch {micro}, "
            f"or plan with a micro-batch of {micro}"
        ) from exc
    checkpointer.record_micro_batch(micro, accumulation)
    _tell_the_queue(micro, accumulation, checkpointer)
    events.append({"step": step, "micro_batch": micro, "accumulation": accumulation})
    raise OutOfMemoryDuringCollective(
        f"{where}: recorded micro-batch {micro} x {accumulation} accumulation in "
        f"{checkpointer.directory}; the launcher's restart resumes from the last checkpoint with it"
    ) from exc


def _tell_the_queue(micro: int, accumulation: int, checkpointer: Checkpointer) -> None:
    """Under `redline submit`, the record also goes where the queue looks (``$REDLINE_QUEUE_RECORDS``): a job that
    ends with it is requeued, and its next attempt resumes from the checkpoints with the smaller micro-batch."""
    records = os.environ.get(REDLINE_QUEUE_RECORDS)
    if records:
        record = {"micro_batch": micro, "accumulation": accumulation, "checkpoint_dir": str(checkpointer.directory)}
        with contextlib.suppress(OSError):
            Path(records, QUEUE_OOM_RECORD).write_text(json.dumps(record))


def recorded_micro_batch(
    checkpointer: Checkpointer, *, micro_batch: int, accumulation: int, rank: int
) -> tuple[int, int] | None:
    """The (micro-batch, accumulation) an earlier attempt recorded after an out-of-memory in a collective, where
    it applies to this run: smaller than the current micro-batch, the same per-rank batch."""
    recorded = checkpointer.recorded_micro_batch()
    if recorded is None:
        return None
    micro, smaller_accumulation = recorded
    if rank == 0:
        log.warning(
            "%s records micro-batch %d x %d after an out-of-memory; it is cleared when the run completes",
            checkpointer.micro_batch_path,
            micro,
            smaller_accumulation,
        )
    if micro >= micro_batch or micro * smaller_accumulation != micro_batch * accumulation:
        return None
    if rank == 0:
        log.warning(
            "micro-batch %d x %d accumulation, as recorded after an out-of-memory in a gradient collective",
            micro,
            smaller_accumulation,
        )
    return recorded


class SimulatedOutOfMemory:
    """The ``REDLINE_TEST_OOM_AT`` hook: an out-of-memory error in a micro-batch's backward, once, in the first
    launch attempt only (a restarted run must not meet it again)."""

    def __init__(self) -> None:
        self.at = _parse_oom_hook(os.environ.get(REDLINE_TEST_OOM_AT))

    def maybe_raise(self, *, step: int, rank: int, micro_index: int) -> None:
        if self.at == (step, rank, micro_index):
            self.at = None
            raise torch.OutOfMemoryError(f"{REDLINE_TEST_OOM_AT}: simulated out of memory at step {step}")


def _parse_oom_hook(text: str | None) -> tuple[int, int, int] | None:
    """``STEP:RANK[:MICRO]`` (micro-batch index within the step, 0 by default); ignored in a restart."""
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    step, rank, micro, *_ = [*text.split(":"), "0", "0"]
    return int(step), int(rank or 0), int(micro or 0)
