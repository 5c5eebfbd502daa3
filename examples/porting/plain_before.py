"""A training loop written for one process (docs/porting.md shows it before and after its port to redline): a
small regression on synthetic data, AdamW, the learning rate halved each epoch, a validation loss per epoch,
the weights saved."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def samples(count: int, seed: int) -> TensorDataset:
    draw = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 16, generator=draw)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).tanh())


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train = DataLoader(samples(1024, 1), batch_size=32, shuffle=True)
    val = DataLoader(samples(256, 2), batch_size=64)
    for epoch in range(3):
        model.train()
        for x, y in train:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        model.eval()
        with torch.no_grad():
            val_loss = sum(nn.functional.mse_loss(model(x.to(device)), y.to(device), reduction="sum") for x, y in val)
        print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
