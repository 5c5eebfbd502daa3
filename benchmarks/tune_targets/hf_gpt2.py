"""A Hugging Face GPT-2 built from a config (random weights: nothing is downloaded) trained on synthetic token
sequences through redline.prepare: one of `tune_vs_grid.py`'s targets.

    python benchmarks/tune_targets/hf_gpt2.py [--batch 16] [--epochs 1]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import transformers

import redline

SEQ, VOCAB = 64, 1024


def build() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The model and one sample's input shape: the factory `redline tune -m` (the planner) takes."""
    config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=VOCAB)
    return transformers.GPT2LMHeadModel(config), (SEQ,)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = build()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2048, SEQ + 1), generator=generator)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    run = redline.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4), loader, loss_fn=loss_fn)
    for inputs, targets in run.micro_batches(epochs=args.epochs):
        with run.accumulate():
            run.forward_backward(inputs, targets)


if __name__ == "__main__":
    main()
