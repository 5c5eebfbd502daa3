"""Training a small regression under an FSDP2 plan, then evaluating it as scripts do: run by
``test_evaluation.py`` through ``redline run`` (2 ranks) or ``spawn_ranks``.

Environment: OUT (rank 0 writes a ``torch.save`` file there), EVAL: ``all`` (every rank evaluates its half of
the validation samples in ``run.evaluating()``), ``rank0`` (rank 0 alone runs ``run.model`` under
``torch.no_grad()``, as a script written for DDP does), ``state_rank0`` (rank 0 alone asks for
``run.state_dict()``), or ``mixed`` (rank 0 evaluates alone, then every rank asks for ``run.state_dict()``);
WAIT (``wait_for_ranks_s``).
"""

from __future__ import annotations

import os

import torch
from order_worker import LR, Samples, model
from torch import nn

from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    net = model()
    data = torch.utils.data.DataLoader(Samples(32), batch_size=4)
    plan = RunConfig(strategy=Strategy(data=world, micro_batch=4, sharding="fsdp", precision="fp32"))
    run = prepare(
        net, torch.optim.SGD(net.parameters(), lr=LR), data, plan=plan, wait_for_ranks_s=float(os.environ["WAIT"])
    )
    for x, y, _, _ in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    validation = Samples(40)
    x, y = validation.x[run.rank :: world], validation.y[run.rank :: world]  # each rank its share
    result: dict = {}
    if os.environ["EVAL"] == "all":
        with run.evaluating() as evaluated:
            result["in_eval_mode"] = not evaluated.training
            total = nn.functional.mse_loss(evaluated(x), y, reduction="sum")
            result["grad_enabled"] = torch.is_grad_enabled()
        torch.distributed.all_reduce(total)
        result["loss"] = total.item() / len(validation)
        result["training_after"] = run.model.training
        result["whole"] = run.state_dict()
    elif os.environ["EVAL"] == "rank0" and run.is_main:
        with torch.no_grad():
            run.model(validation.x)
    elif os.environ["EVAL"] == "state_rank0" and run.is_main:
        run.state_dict()
    elif os.environ["EVAL"] == "mixed":  # rank 0 evaluates alone, then every rank asks for the whole model
        if run.is_main:
            with torch.no_grad():
                run.model(validation.x)
        run.state_dict()
    if run.is_main:
        torch.save(result | {"validation": (validation.x, validation.y)}, os.environ["OUT"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
