"""A training script written for torchrun and DistributedDataParallel (docs/porting.md shows it before and
after its port to redline): each rank its share of the samples through a DistributedSampler, ``batch_size``
per rank, rank 0 validating, printing and saving."""

import redline
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def samples(count: int, seed: int) -> TensorDataset:
    draw = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 16, generator=draw)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).tanh())


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = samples(1024, 1)
    train = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    val = DataLoader(samples(256, 2), batch_size=64)
    run = redline.prepare(model, optimizer, train, scheduler=scheduler, scheduler_interval="epoch")
    rank, device = run.rank, run.device
    for epoch in run.epochs(3):
        for x, y in run.micro_batches():
            with run.accumulate():
                loss = nn.functional.mse_loss(run.model(x), y)
                run.backward(loss)
        with run.evaluating() as net:
            val_loss = sum(nn.functional.mse_loss(net(x.to(device)), y.to(device), reduction="sum") for x, y in val)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    state = run.state_dict()
    if rank == 0:
        torch.save(state, "model.pt")

if __name__ == "__main__":
    main()
