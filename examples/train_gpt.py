"""A small GPT-style language model on synthetic tokens: a plain PyTorch loop with redline's few lines.

    python examples/train_gpt.py                                  # one process, CPU or GPU, defaults
    redline run --nproc-per-node 2 examples/train_gpt.py --epochs 1
    redline monitor                                               # meanwhile: the GPUs, the host, its steps

or plan this model (its factory, one sample's 64 tokens, the loader's batch of 32) for this machine first, from
the repository's root (on a machine without a GPU, after `redline bench compute memory --save` once), and run
the plan:

    redline plan --model examples.train_gpt:Gpt --input-shape 64 --global-batch 32 --hardware local -o plan.yaml
    redline run --plan plan.yaml examples/train_gpt.py

A plan made for another model or device is refused (`redline run --plan-anyway` runs it all the same).

The lines marked `# redline` are all that differs from the same loop without redline.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import redline  # redline
from redline.monitor.steps import DEFAULT_STEPS  # redline


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # each head's query, key and value side by side (Megatron's layout), the heads counted by -1: a
        # tensor-parallel rank's share of qkv is whole heads, and the block computes with those it holds
        q, k, v = self.qkv(self.norm1(x)).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class Gpt(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 4, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.redline_pp_modules = {"first": ("embed", "position"), "last": ("norm", "head")}  # redline

    def redline_tp_plan(self, degree: int, sequence_parallel: bool = False) -> dict:  # redline: how a
        # tensor-parallel plan splits the layers; under sequence parallelism the residual stream between the
        # projections holds each rank's rows of the sequence (a DTensor), the norms compute on those
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        rows = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
        stream = {"output_layouts": rows, "use_local_output": not sequence_parallel}
        plan = {
            "embed": RowwiseParallel(input_layouts=Replicate(), **stream),  # vocabulary-sharded
            "blocks.*.qkv": ColwiseParallel(input_layouts=rows),  # whole heads per rank
            "blocks.*.proj": RowwiseParallel(**stream),
            "blocks.*.mlp.0": ColwiseParallel(input_layouts=rows),
            "blocks.*.mlp.2": RowwiseParallel(**stream),
            "head": ColwiseParallel(input_layouts=rows, output_layouts=Replicate()),  # the logits whole on every rank
        }
        if sequence_parallel:
            plan |= {
                "position": PrepareModuleOutput(  # each rank's rows of the position embeddings
                    output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=False
                ),
                "blocks.*.norm1": SequenceParallel(),
                "blocks.*.norm2": SequenceParallel(),
                "norm": SequenceParallel(),
            }
        return plan

    # redline: how a pipeline-parallel plan runs the model in stages: one stage's share of forward (the same code,
    # cut), and the modules the first and the last stage use besides the blocks (redline_pp_modules, above)
    def redline_pp_stage(self, x: torch.Tensor, blocks: list[nn.Module], *, first: bool, last: bool) -> torch.Tensor:
        if first:
            x = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in blocks:
            x = block(x)
        return self.head(self.norm(x)) if last else x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.redline_pp_stage(tokens, self.blocks, first=True, last=True)


def synthetic_tokens(samples: int, seq: int, vocab: int) -> torch.utils.data.TensorDataset:
    """Sequences with structure to learn: each token is the previous one plus a fixed step, modulo vocab."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (samples, 1), generator=generator)
    step = torch.randint(1, 4, (samples, 1), generator=generator)
    tokens = (start + step * torch.arange(seq + 1)) % vocab
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(synthetic_tokens(2048, 64, 512), batch_size=args.batch, shuffle=True)

    # redline: step metrics where `redline monitor` looks for them (`redline run --metrics` puts them elsewhere)
    run = redline.prepare(
        model, optimizer, loader, loss_fn=loss_fn, checkpoint_dir=args.checkpoint_dir, metrics_path=DEFAULT_STEPS
    )
    for tokens, targets in run.micro_batches(epochs=args.epochs):  # redline: was `for ... in loader`
        with run.accumulate():  # redline
            # redline: was loss_fn(model(tokens), targets).backward(); optimizer.step(); optimizer.zero_grad()
            run.forward_backward(tokens, targets)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


if __name__ == "__main__":
    main()
