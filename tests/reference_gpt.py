"""A GPT written the way Megatron-style code is: nn.LayerNorm, one QKV projection,
``scaled_dot_product_attention``, a fused tanh GELU, no dropout, an output projection tied to the embedding.
A model a user would hand the planner as a factory; the analytic formulas describe it exactly. Its
tensor-parallel plan (``redline_tp_plan``) splits the blocks; attention counts its heads by ``-1``, so a
rank computes with the heads it holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redline.workload.profile import TransformerShape


class Block(nn.Module):
    def __init__(self, h: int, heads: int, f: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, shape: TransformerShape) -> None:
        super().__init__()
        h = shape.hidden
        self.wte, self.wpe = nn.Embedding(shape.vocab, h), nn.Embedding(shape.position_embeddings, h)
        self.blocks = nn.ModuleList(Block(h, shape.heads, shape.ffn_hidden) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(h)

    def redline_tp_plan(self, degree: int) -> dict:
        """The blocks split; the embedding stays whole: the output projection multiplies by its weight."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from redline.runtime.tensor_parallel import PackedColwiseParallel

        return {
            "blocks.*.qkv": PackedColwiseParallel(packed=3),  # [q | k | v]: each rank its heads of each
            "blocks.*.proj": RowwiseParallel(),
            "blocks.*.fc1": ColwiseParallel(),
            "blocks.*.fc2": RowwiseParallel(),
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # tied output projection
