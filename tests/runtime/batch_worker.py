"""A DDP-convention script, where the loader's batch is each rank's: run as gloo ranks by ``spawn_ranks``
(``test_batch_semantics.py``), once as written for torch's DistributedDataParallel without redline and once
ported to ``prepare()`` without a plan, each writing its weights.

Environment: OUT (rank 0 writes a ``torch.save`` file there), MODE (``ddp``: the script without redline;
``redline``: its port), SAMPLES, BATCH (the loader's batch_size), EPOCHS, and for the port optionally
LOADER_BATCH (``prepare(loader_batch=...)``) and BATCHES (a JSON list of index lists: the loader draws these
batches from a batch sampler of the script's own instead of a DistributedSampler's share).
"""

from __future__ import annotations

import json
import os

import torch
from order_worker import LR, Samples, model
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ranks import leave_together


class GivenBatches(torch.utils.data.Sampler[list[int]]):
    """A batch sampler of the script's own: the same batches, in the same order, every epoch."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def without_redline(data: Samples, batch: int, epochs: int) -> nn.Module:
    """The script as a DDP tutorial writes it: each rank's share of the samples, ``batch`` per rank."""
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    net = model()
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y, _, _ in loader:
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return net


def ported(data: Samples, batch: int, epochs: int) -> tuple[nn.Module, dict]:
    """The same script through ``prepare()``: its loader as it was, no plan."""
    from redline.runtime.prepare import prepare

    if os.environ.get("BATCHES"):
        loader = DataLoader(data, batch_sampler=GivenBatches(json.loads(os.environ["BATCHES"])))
    else:
        loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False))
    net = model()
    run = prepare(net, torch.optim.SGD(net.parameters(), lr=LR), loader, loader_batch=os.environ.get("LOADER_BATCH"))
    seen: list[list[int]] = []
    for x, y, index, _ in run.micro_batches(epochs=epochs):
        seen.append(index.tolist())
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    samples = [record.samples for record in run.metrics.records]  # per step, over every rank
    return net, {"seen": seen, "steps": run.step, "steps_per_epoch": run.steps_per_epoch, "samples": samples}


def main() -> None:
    torch.distributed.init_process_group(
        "gloo",
        init_method="file://" + os.environ["STORE"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    data = Samples(int(os.environ["SAMPLES"]))
    batch, epochs = int(os.environ["BATCH"]), int(os.environ.get("EPOCHS", "1"))
    mine: dict = {}
    if os.environ["MODE"] == "ddp":
        net = without_redline(data, batch, epochs)
    else:
        net, mine = ported(data, batch, epochs)
    gathered: list[dict | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if torch.distributed.get_rank() == 0:
        weights = {name: p.detach().clone() for name, p in net.named_parameters()}
        torch.save({"weights": weights, "ranks": gathered}, os.environ["OUT"])
    leave_together()


if __name__ == "__main__":
    main()
