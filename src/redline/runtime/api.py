"""``redline.prepare()``, defined where importing it costs nothing.

``import redline`` stays cheap (no torch: tests/test_import.py), yet ``help(redline.prepare)`` and
``inspect.signature(redline.prepare)`` show the real parameters. So the one ``prepare`` function lives here:
its annotations are strings (``from __future__ import annotations``) naming types imported for type checkers
only, and the runtime, torch with it, is imported when it is called. ``redline.prepare`` and
``redline.runtime.prepare.prepare`` are this function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from redline.runtime.config import RunConfig
    from redline.runtime.parallelize import OptimizerFactory
    from redline.runtime.pipeline import LossFn
    from redline.runtime.prepare import Run


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    data: torch.utils.data.DataLoader,
    *,
    plan: str | Path | RunConfig | None = None,
    scheduler: Any = None,
    loss_fn: LossFn | None = None,
    **overrides: Any,
) -> Run:
    """Apply a plan to your own model, optimizer and DataLoader; the ``Run`` returned drives your loop::

        run = redline.prepare(model, optimizer, loader, plan="plan.yaml")
        for x, y in run.micro_batches():
            with run.accumulate():
                run.backward(loss_fn(run.model(x), y))

    - ``model``: your ``nn.Module``; ``run.model`` is it on this rank's device, wrapped as the plan says, every rank
      starting from rank 0's parameters and buffers (a seed per rank is fine; said once when the ranks' differed).
    - ``optimizer``: an optimizer over the model's trainable parameters, in as many parameter groups as you like
      (kept where sharding replaces the parameters, FSDP2, tensor and pipeline parallelism: its groups hold the
      new ones, found by module path; rebuilt from its class, each group with its settings, where ZeRO-1 shares
      its state out or it has state already), or
      a factory ``lambda params: AdamW(params, ...)``, which receives the wrapped model's trainable parameters
      (``params.named``: the same with their module paths, for groups split by name).
    - ``data``: your DataLoader, every setting kept, its samples shared out over the ranks, its batch each
      rank's (``loader_batch="global"``: the global batch).
    - ``plan``: a plan file (``redline plan -o``), a ``RunConfig``, or None: ``$REDLINE_PLAN``, else defaults
      for this machine. A plan made for another kind of device or another model is refused (``PlanMismatch``,
      saying how to re-plan) unless ``plan_anyway=True`` (``redline run --plan-anyway``).
    - ``scheduler``: an LR scheduler over the optimizer, or a factory ``lambda optimizer: ...``, which a
      rebuilt optimizer needs.
    - ``loss_fn``: ``loss_fn(output, target)``, for ``run.forward_backward``; a pipeline-parallel plan needs it
      (its last stage computes the loss).
    - ``overrides``: settings by keyword (``checkpoint_dir=...``, ``metrics_path=...``: ``config.SETTINGS``;
      None leaves one as the plan has it); ``redline run``'s options win over them.

    What is applied, in which order: ``redline.runtime.prepare``'s docstring; what the loop uses: ``Run``'s.
    """
    from redline.runtime.prepare import Run

    return Run(model, optimizer, data, plan=plan, scheduler=scheduler, loss_fn=loss_fn, **overrides)
