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
