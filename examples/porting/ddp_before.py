"""A training script written for torchrun and DistributedDataParallel (docs/porting.md shows it before and
after its port to redline): each rank its share of the samples through a DistributedSampler, ``batch_size``
per rank, rank 0 validating, printing and saving."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def samples(count: int, seed: int) -> TensorDataset:
    draw = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 16, generator=draw)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).tanh())


def main() -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = samples(1024, 1)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    train = DataLoader(data, batch_size=16, sampler=sampler)
    val = DataLoader(samples(256, 2), batch_size=64)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        if rank == 0:
            model.eval()
            with torch.no_grad():
                net = model.module
                val_loss = sum(nn.functional.mse_loss(net(x.to(device)), y.to(device), reduction="sum") for x, y in val)
            print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
