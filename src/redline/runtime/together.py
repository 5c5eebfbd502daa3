"""Work every rank must do together, checked where a script might do it on one rank only.

A sharded model (FSDP2, HSDP, tensor parallelism) gathers its parameters from every rank in each forward, and
its whole state dict from every rank too. A script written for one process or for DDP evaluates on rank 0
only (``if rank == 0: evaluate(model)``): under DDP that works, each rank holding the whole model; sharded,
rank 0 waits in its first gather for ranks that went on training, and the job hangs without a word until
the backend's own timeout (30 minutes, NCCL's ten) ends it with a message about a collective.

``Together`` makes the ranks meet before the first forward outside training after each optimizer step, and
before ``run.state_dict()``: a barrier over a gloo group of its own (``monitored_barrier``, which names the
ranks that did not come) that waits ``wait_for_ranks_s``. A rank left alone ends the run with one line
naming the cause and the fix (``run.evaluating()`` on every rank; ``run.is_main`` for what only rank 0
does). Ranks that all evaluate meet at once: one tiny exchange per evaluation.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from redline.errors import RedlineError


class RanksApart(RedlineError):
    """A rank reached work every rank must do together, and the others did not come."""


class Together:
    """The meeting point of the ranks of a sharded run (``how`` says how it is sharded; None: every rank holds
    the whole model, and nothing need meet). ``training()`` marks the forwards of the training step, which
    need no check (every rank runs the step); ``stepped()`` is called after each optimizer step."""

    def __init__(self, *, how: str | None, world: int, rank: int, wait_s: float) -> None:
        self.how = how
        self.rank = rank
        self.wait_s = wait_s
        self._group = dist.new_group(backend="gloo") if how is not None and world > 1 else None
        self._in_step = False
        self._met = False  # the ranks met since the last optimizer step (a forward outside it needs no more)

    @property
    def active(self) -> bool:
        return self._group is not None

    def watch(self, model: nn.Module) -> None:
        """A forward of ``model`` outside the training step meets the other ranks first, once per step."""
        if self.active:  # before FSDP2's own pre-forward hook, which gathers the root's parameters
            model.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self._in_step and not self._met:
            self.meet("ran the model outside the training step (an evaluation?)")
            self._met = True

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The forwards and backwards of a training step: every rank runs them."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def stepped(self) -> None:
        self._met = False

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module, autocast: contextlib.AbstractContextManager) -> Iterator[nn.Module]:
        """An evaluation every rank runs: the ranks meet, then the model in eval mode without gradients under
        the plan's autocast, its training mode as it was afterwards."""
        self.meet("began an evaluation (run.evaluating())")
        self._met = True
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast:
                yield model
        finally:
            model.train(was)

    def meet(self, doing: str) -> None:
        """Wait up to ``wait_s`` for every rank to get here; RanksApart naming the ranks that did not. Ranks
        that met for different work (rank 0 evaluating alone while the others ask for the state dict) would
        pair their gathers wrongly: they compare what they came for, and end the run where it differs."""
        if self._group is None:
            return
        try:
            dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=self.wait_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise RanksApart(self._apart(doing, str(exc))) from None
        came_for: list[str | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(came_for, doing, group=self._group)
        others = sorted({(what, rank) for rank, what in enumerate(came_for) if what != doing})
        if others:
            what, rank = others[0]
            raise RanksApart(
                f"rank {self.rank} {doing} while rank {rank} {what}: under sharding ({self.how}) every rank does "
                "the same work outside the training step, so evaluate on every rank (`with run.evaluating():`) "
                "and keep what only rank 0 does under `if run.is_main:`"
            )

    def _apart(self, doing: str, error: str) -> str:
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", error)
        others = f"rank(s) {missing.group(1).strip()}" if missing else "the other ranks"
        if self.rank != 0 and not missing:  # it came; rank 0, which gathers the others, did not answer
            others = "rank 0 (or a rank rank 0 waited for)"
        return (
            f"rank {self.rank} {doing} and {others} did not within {self.wait_s:g} s: the model is sharded "
            f"({self.how}) and every forward gathers it from every rank, so evaluate on every rank "
            "(`with run.evaluating():`) and keep what only rank 0 does under `if run.is_main:`"
        )
