"""Where the training loop stands in the batch in hand: one value per batch, made, read and dropped.

``Run``'s batch generator makes a ``BatchState`` for each pass over a loaded batch (a second pass after an
agreed out-of-memory gets a fresh one) and moves its ``micro_index`` along as it yields the micro-batches;
``accumulate()`` and ``backward()`` read it (is this micro-batch the last one, what share of the batch's loss
is its loss) and write what happened (the loss summed so far, the optimizer step taken, an error, a replay);
the generator hands it back to the epoch loop when the batch is done, and it is dropped. (Outside
``micro_batches()``, in a loop of the user's own, each micro-batch is a whole batch with a state of its own.)
accelerate keeps the same facts in its ``GradientState``; nanoGPT in one line, ``micro_step == accumulation - 1``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class BatchState:
    """One batch's progress through its micro-batches and its optimizer step."""

    loss_divisors: list[float]
    """Per micro-batch, what its loss is divided by to make it its share of the batch's mean loss (the number
    of micro-batches, or, where they differ in size, the batch's size over the micro-batch's)."""
    micro_index: int = 0
    """The micro-batch in hand (0-based)."""
    loss_sum: torch.Tensor | float = 0.0
    """The loss shares of the micro-batches backpropagated so far, detached: a tensor, so that adding to it does
    not wait for the GPU."""
    bucket_ready_mark: Any = None
    """``StepMetrics.mark()`` at the last DDP gradient bucket ready in the running backward (None: none yet)."""
    replay: bool = False
    """The ranks agreed that a micro-batch ran out of memory: the batch again, split finer."""
    stepped: bool = False
    """The batch's optimizer step is done (a loop that breaks after it has trained on the batch)."""
    failed: bool = False
    """An error left a micro-batch: other ranks may sit in a collective, so the run ends without one."""
    stop_agreed: bool = False
    """Some rank was asked to stop by a signal: every rank checkpoints after this batch and leaves."""

    @property
    def boundary(self) -> bool:
        """The micro-batch in hand ends the batch: its backward synchronises the gradients, and the optimizer
        steps after it."""
        return self.micro_index == len(self.loss_divisors) - 1

    @property
    def loss_divisor(self) -> float:
        """The micro-batch in hand's loss over this is its share of the batch's mean loss."""
        return self.loss_divisors[self.micro_index]
