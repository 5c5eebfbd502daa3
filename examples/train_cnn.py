"""A small CNN image classifier on synthetic images: a plain PyTorch loop with redline's few lines.

    python examples/train_cnn.py
    redline run --nproc-per-node 2 examples/train_cnn.py
    redline monitor                                    # meanwhile: the GPUs, the host, its steps

The lines marked `# redline` are all that differs from the same loop without redline.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import redline  # redline
from redline.monitor.steps import DEFAULT_STEPS  # redline


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 10, channels: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean(dim=(2, 3)))


def synthetic_images(samples: int, classes: int = 10) -> torch.utils.data.TensorDataset:
    """32x32 images whose class is a brightness pattern: learnable in a few epochs."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    images = torch.randn(samples, 3, 32, 32, generator=generator) * 0.5
    images[torch.arange(samples), labels % 3] += (labels.float() / classes).view(-1, 1, 1)
    return torch.utils.data.TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = SmallResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(synthetic_images(2048), batch_size=args.batch, shuffle=True)

    # redline: step metrics where `redline monitor` looks for them (`redline run --metrics` puts them elsewhere)
    run = redline.prepare(model, optimizer, loader, checkpoint_dir=args.checkpoint_dir, metrics_path=DEFAULT_STEPS)
    for images, labels in run.micro_batches(epochs=args.epochs):  # redline: was `for ... in loader`
        with run.accumulate():  # redline
            loss = F.cross_entropy(run.model(images), labels)
            run.backward(loss)  # redline: was loss.backward(); optimizer.step(); optimizer.zero_grad()


if __name__ == "__main__":
    main()
