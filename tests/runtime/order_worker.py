"""A small regression trained through ``prepare()`` on samples that carry their index, writing what each rank
trained on: run as gloo ranks by ``spawn_ranks`` (``test_data_order.py``), which compares it with ``plain_loop``,
the same loop without redline in one process.

Environment: OUT (rank 0 writes a ``torch.save`` file there), SAMPLES, BATCH (the loader's batch: without a
plan, the global batch), and optionally SEED (each rank calls ``torch.manual_seed(SEED + rank)`` before
``prepare``, as nanoGPT seeds its ranks), GENERATOR (the loader gets ``generator=torch.Generator().manual_seed(
GENERATOR)``), DROP_LAST (1: the loader's ``drop_last=True``), ACCUMULATION (micro-batches per rank's batch,
through a plan), SHARDING (the plan's: ddp or fsdp), WORKERS (DataLoader workers), EPOCHS.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ranks import leave_together

LR = 0.3


class Samples(torch.utils.data.Dataset):
    """Sample ``i``: features, a target, ``i`` itself, and a random number drawn when it is loaded (in a
    DataLoader worker, where there are workers): what a random augmentation would draw."""

    def __init__(self, count: int) -> None:
        draw = torch.Generator().manual_seed(1)
        self.x = torch.randn(count, 4, generator=draw)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        return self.x[index], self.y[index], index, torch.rand(())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def loader(samples: int, batch: int, *, generator: int | None, drop_last: bool, workers: int = 0):
    return torch.utils.data.DataLoader(
        Samples(samples),
        batch_size=batch,
        shuffle=True,
        drop_last=drop_last,
        num_workers=workers,
        # a rank forked from the test's fork server starts processes through it (pickling the dataset, a new
        # server importing torch): a worker forked from the rank starts in no time
        multiprocessing_context="fork" if workers else None,
        generator=None if generator is None else torch.Generator().manual_seed(generator),
    )


def plain_loop(samples: int, order: list[int], batch: int) -> dict:
    """One process without redline, the loop ``main`` runs through ``prepare``: of ``samples``, those of
    ``order`` in turn, in batches of ``batch`` (the last one short where it is)."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for x, y, _, _ in torch.utils.data.DataLoader(Samples(samples), batch_size=batch, sampler=order):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"weights": {name: p.detach().clone() for name, p in net.named_parameters()}, "losses": losses}


def main() -> None:
    from redline.plan.strategy import Strategy
    from redline.runtime.config import RunConfig
    from redline.runtime.prepare import prepare

    torch.distributed.init_process_group(
        "gloo",
        init_method="file://" + os.environ["STORE"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    net = model()
    if os.environ.get("SEED"):
        torch.manual_seed(int(os.environ["SEED"]) + rank)
    batch = int(os.environ["BATCH"])
    data = loader(
        int(os.environ["SAMPLES"]),
        batch,
        generator=int(os.environ["GENERATOR"]) if os.environ.get("GENERATOR") else None,
        drop_last=os.environ.get("DROP_LAST") == "1",
        workers=int(os.environ.get("WORKERS", "0")),
    )
    accumulation = int(os.environ.get("ACCUMULATION", "1"))
    strategy = Strategy(
        data=world,
        micro_batch=batch // world // accumulation,
        accumulation=accumulation,
        sharding=os.environ.get("SHARDING", "ddp"),
        precision="fp32",
    )
    run = prepare(net, torch.optim.SGD(net.parameters(), lr=LR), data, plan=RunConfig(strategy=strategy))
    seen: dict[int, list[int]] = {}  # per optimizer step, the indices this rank loaded
    noise: list[float] = []
    for x, y, index, drawn in run.micro_batches(epochs=int(os.environ.get("EPOCHS", "1"))):
        seen.setdefault(run.step, []).extend(index.tolist())
        noise += drawn.tolist()
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in net.named_parameters()
    }
    mine = {"seen": [seen[step] for step in sorted(seen)], "noise": noise}
    gathered: list[dict | None] = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        result = {"weights": weights, "losses": [record.loss for record in run.metrics.records], "ranks": gathered}
        torch.save(result, os.environ["OUT"])
    leave_together()


if __name__ == "__main__":
    main()
