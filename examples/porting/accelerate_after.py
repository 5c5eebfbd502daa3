"""A training script written for Hugging Face Accelerate (docs/porting.md shows it before and after its port to
redline), run by ``accelerate launch`` or torchrun: ``batch_size`` per process, two batches per optimizer step
(gradient accumulation), a learning rate that falls linearly over every step, the validation shared out over
the processes and summed."""

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
    train = DataLoader(samples(1024, 1), batch_size=32, shuffle=True)
    val = DataLoader(samples(256, 2), batch_size=64)
    run = redline.prepare(model, optimizer, train, accumulation=2)
    steps = run.total_steps(3)
    scheduler = torch.optim.lr_scheduler.LinearLR(run.optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)
    run.register_for_checkpointing(scheduler)
    for epoch in run.epochs(3):
        for x, y in run.micro_batches():
            with run.accumulate():
                loss = nn.functional.mse_loss(run.model(x), y)
                run.backward(loss)
            if run.optimizer_stepped:
                scheduler.step()
        with run.evaluating() as model:
            val_loss = sum(nn.functional.mse_loss(model(x.to(run.device)), y.to(run.device), reduction="sum") for x, y in val)
        if run.is_main:
            print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    state = run.state_dict()
    if run.is_main:
        torch.save(state, "model.pt")


if __name__ == "__main__":
    main()
