"""A training script written for Lightning Fabric (docs/porting.md shows it before and after its port to
redline), run by ``fabric run --devices N``: ``batch_size`` per process, the learning rate halved each epoch,
the validation shared out over the processes and summed."""

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
    train = DataLoader(samples(1024, 1), batch_size=16, shuffle=True)
    val = DataLoader(samples(256, 2), batch_size=64)
    run = redline.prepare(model, optimizer, train, scheduler=scheduler, scheduler_interval="epoch")
    for epoch in run.epochs(3):
        for x, y in run.micro_batches():
            with run.accumulate():
                loss = nn.functional.mse_loss(run.model(x), y)
                run.backward(loss)
        with run.evaluating() as model:
            val_loss = sum(nn.functional.mse_loss(model(x.to(run.device)), y.to(run.device), reduction="sum") for x, y in val)
        if run.is_main:
            print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    state = run.state_dict()
    if run.is_main:
        torch.save(state, "model.pt")


if __name__ == "__main__":
    main()
