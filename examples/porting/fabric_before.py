"""A training script written for Lightning Fabric (docs/porting.md shows it before and after its port to
redline), run by ``fabric run --devices N``: ``batch_size`` per process, the learning rate halved each epoch,
the validation shared out over the processes and summed."""

import torch
from lightning_fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def samples(count: int, seed: int) -> TensorDataset:
    draw = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 16, generator=draw)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).tanh())


def main() -> None:
    fabric = Fabric()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    train = DataLoader(samples(1024, 1), batch_size=16, shuffle=True)
    val = DataLoader(samples(256, 2), batch_size=64)
    train, val = fabric.setup_dataloaders(train, val)
    for epoch in range(3):
        model.train()
        for x, y in train:
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        model.eval()
        with torch.no_grad():
            val_loss = sum(nn.functional.mse_loss(model(x), y, reduction="sum") for x, y in val)
        val_loss = fabric.all_reduce(val_loss, reduce_op="sum")
        fabric.print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    fabric.save("model.pt", {"model": model})


if __name__ == "__main__":
    main()
