"""Measures, per rank, the activation bytes of one training step run by ``prepare()`` on the CPU, with PyTorch's
``MemTracker``: run by ``spawn_ranks`` (gloo) for tensor, pipeline and data parallelism, and as one process.

The first steps run untracked (they make the optimizer's states, DDP its buckets); the third and the fourth are
tracked, each whole, and each figure is the smaller of the two: under a pipeline the schedule's every micro-batch,
with as many in flight as it keeps. MemTracker files every
tensor made in a forward (and in a checkpointed block's recomputation) under "Activation". The worker keeps of
that category: what is held as each backward begins (what the forward passes in flight saved for their
backward: the plan's ``activations``), the peak through the forward passes (with their transient tensors), and
the peak through the whole step (with a checkpointed block's recomputation on top).

Environment: MODEL (``tp_worker.make_model``'s kinds), LAYERS (its blocks, 4 unless given), STRATEGY (JSON of
Strategy fields), OUT (a prefix: each rank writes OUT.RANK.json, {"saved": bytes, "forward": bytes, "step": bytes}).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pp_worker
import torch
import torch.nn.functional as F
import tp_worker

# the step tracked: DDP rebuilds its gradient buckets in the second step's forward, which MemTracker would file
# under "Activation"
TRACKED = 2
TRACKED_STEPS = 2


def gpt() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The repo's GPT (examples/train_gpt.py) with LAYERS blocks and its input's shape: a factory for
    ``redline plan --model activation_worker:gpt``."""
    return tp_worker.make_model("gpt", layers=int(os.environ.get("LAYERS", "4"))), (tp_worker.SEQ,)


def activation_tracker() -> Any:
    """A MemTracker that keeps the peak of its "Activation" category, in the forward and over the whole step (its
    own peak is of the total, which the other categories' sizes decide)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from redline.workload.measured_memory import peak_only_mem_tracker

    class ActivationTracker(peak_only_mem_tracker()):  # type: ignore[misc]
        saved = 0  # the most held as a backward begins: what the forward passes in flight saved
        forward_peak = 0  # the most at any point of a forward (with its transient tensors)
        step_peak = 0  # the most at any point of the step (with a checkpointed block's recomputation)
        _last_forward = 0  # after the latest forward operator
        _in_backward = False

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            # a root module's next forward in the same step (a pipeline's micro-batches in flight) is one MemTracker
            # refuses, taking it for the next iteration: forget its module statistics (only the category's
            # global figures are read), so it starts them again
            name = self._mod_tracker.get_known_fqn(module)
            root = set(self._mod_tracker.parents) - {name} == {"Global"}
            if root and not self._mod_tracker.is_bw and module in self.memory_tracking:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            current = sum(snapshot.get(_MemRefType.ACT, 0) for snapshot in self._curr_mem_snap.values())
            self.step_peak = max(self.step_peak, current)
            backward = self._mod_tracker.is_bw
            if backward and not self._in_backward:
                self.saved = max(self.saved, self._last_forward)
            elif not backward:
                self.forward_peak = max(self.forward_peak, current)
                self._last_forward = current
            self._in_backward = backward

    return ActivationTracker()


def main() -> None:
    from redline.plan.strategy import Strategy
    from redline.runtime.config import RunConfig
    from redline.runtime.prepare import prepare

    if "STORE" in os.environ:
        torch.distributed.init_process_group(
            "gloo",
            init_method="file://" + os.environ["STORE"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    strategy = Strategy(**json.loads(os.environ["STRATEGY"]))
    model = tp_worker.make_model(os.environ["MODEL"], layers=int(os.environ.get("LAYERS", "4")))
    loader = torch.utils.data.DataLoader(
        tp_worker.dataset(), batch_size=strategy.micro_batch * strategy.accumulation * strategy.data
    )
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    run = prepare(model, optimizer, loader, plan=RunConfig(strategy=strategy), loss_fn=pp_worker.loss_fn)
    # two steps tracked apart, each figure the smaller of the two: on a loaded machine a collective's buffer that
    # another thread frees a moment late can land in one step's snapshot as the backward begins
    tracking, tracked = None, []
    for tokens, targets in run.micro_batches(epochs=TRACKED + TRACKED_STEPS):
        if tracking is None and run.step == TRACKED + len(tracked):
            tracking = activation_tracker()
            tracking.track_external(run.model, run.optimizer)
            tracking.__enter__()
        with run.accumulate():
            if strategy.pipeline > 1:
                run.forward_backward(tokens, targets)
            else:  # the loop holds the logits to the end of the micro-batch, as a training loop does
                logits = tp_worker.logits(run.model, tokens)
                run.backward(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
                del logits
        if tracking is not None and run.step == TRACKED + len(tracked) + 1:
            tracking.__exit__(None, None, None)
            tracked.append(tracking)
            tracking = None
            if len(tracked) == TRACKED_STEPS:
                break
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    figures = {"saved": "saved", "forward": "forward_peak", "step": "step_peak"}
    peaks = {key: min(getattr(tracker, name) for tracker in tracked) for key, name in figures.items()}
    Path(f"{os.environ['OUT']}.{rank}.json").write_text(json.dumps(peaks))
    run.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # leave together: a gloo group torn down under a busy peer can abort it
        torch.distributed.destroy_process_group()
        os._exit(0)


if __name__ == "__main__":
    main()
