"""Small models for the inference tests, as `redline infer -m tiny_nets:NAME` imports them (factories)."""

from __future__ import annotations

import torch
from torch import nn


def classifier() -> tuple[nn.Module, tuple[int, ...]]:
    """16 features in, 10 classes out; seeded, so every process builds the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10)), (16,)


def no_shape() -> nn.Module:
    return nn.Linear(4, 4)


def strings() -> tuple[nn.Module, tuple[int, ...]]:
    class Words(nn.Module):
        def forward(self, x: torch.Tensor) -> str:
            return "not a tensor"

    return Words(), (4,)


def pinned_batch() -> tuple[nn.Module, tuple[int, ...]]:
    """The classifier plus a bias per row of a batch of 2: it runs at batch 2 only, and cannot be exported for
    any other."""

    class PerRow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, _ = classifier()
            self.bias = nn.Parameter(torch.zeros(2, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + self.bias

    return PerRow(), (16,)
