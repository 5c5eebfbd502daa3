"""A training script written for Hugging Face Accelerate (docs/porting.md shows it before and after its port to
redline), run by ``accelerate launch`` or torchrun: ``batch_size`` per process, two batches per optimizer step
(gradient accumulation), a learning rate that falls linearly over every step, the validation shared out over
the processes and summed."""

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def samples(count: int, seed: int) -> TensorDataset:
    draw = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 16, generator=draw)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).tanh())


def main() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = DataLoader(samples(1024, 1), batch_size=16, shuffle=True)
    val = DataLoader(samples(256, 2), batch_size=64)
    steps = 3 * len(train) // accelerator.gradient_accumulation_steps
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)
    model, optimizer, train, val, scheduler = accelerator.prepare(model, optimizer, train, val, scheduler)
    for epoch in range(3):
        model.train()
        for x, y in train:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            val_loss = sum(nn.functional.mse_loss(model(x), y, reduction="sum") for x, y in val)
        val_loss = accelerator.reduce(val_loss, reduction="sum")
        accelerator.print(f"epoch {epoch} loss {loss.item():.6f} val_loss {val_loss.item() / 256:.6f}")
    accelerator.wait_for_everyone()
    accelerator.save(accelerator.unwrap_model(model).state_dict(), "model.pt")


if __name__ == "__main__":
    main()
