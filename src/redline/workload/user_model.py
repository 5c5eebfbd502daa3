"""What redline asks of a user's model, traced on fake tensors or timed for real: what its builder returns,
the input it takes (token ids or floats) and the loss a training step calls backward on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from redline.errors import BadInput


def unpack_build(built: Any, name: str) -> tuple[nn.Module, tuple[int, ...] | None]:
    """The module a builder returned, and the shape of one sample's input when it returned
    ``(module, input_shape)``."""
    shape = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, shape = built
    if not isinstance(built, nn.Module):
        raise BadInput(f"cannot trace {name}: the builder returned {type(built).__name__}, not an nn.Module")
    return built, shape


def input_kind(
    module: nn.Module, input_dtype: torch.dtype | None, vocab_size: int | None
) -> tuple[torch.dtype, int | None, str | None]:
    """The input's dtype and the vocabulary to draw ids from, as given or inferred; a note when inferred."""
    first = next((m for m in module.modules() if next(m.parameters(recurse=False), None) is not None), None)
    embedding = first if isinstance(first, nn.Embedding) else None
    if input_dtype is None:
        if embedding is None:
            return torch.float32, vocab_size, None
        input_dtype = torch.long
        vocab_size = vocab_size or embedding.num_embeddings
        return input_dtype, vocab_size, f"input: token ids below {vocab_size} (the model starts with an nn.Embedding)"
    if vocab_size is None and embedding is not None:
        vocab_size = embedding.num_embeddings
    return input_dtype, vocab_size, None


def lm_logits(output: Any, inputs: torch.Tensor | None, vocab_size: int | None) -> torch.Tensor | None:
    """The output of a language model (token ids in) that holds a score per vocabulary entry for each input
    token, if there is one."""
    if inputs is None or not vocab_size or inputs.is_floating_point():
        return None
    for leaf in tree_leaves(output):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.requires_grad
            and leaf.shape[-1] == vocab_size
            and leaf.shape[:-1] == inputs.shape
        ):
            return leaf
    return None


def training_loss(
    output: Any, inputs: torch.Tensor | None = None, vocab_size: int | None = None
) -> torch.Tensor | None:
    """A scalar to call backward on. For a language model (token ids in, an output whose last dimension is
    the vocabulary) the loss it trains with: cross-entropy on fp32-upcast logits, as Hugging Face models
    compute it, so the memory that loss keeps is measured too. Otherwise the sum of every floating output
    that needs a gradient."""
    logits = lm_logits(output, inputs, vocab_size)
    if logits is not None and inputs is not None:  # logits are found only with the token ids
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), inputs.flatten())
    parts = [
        leaf.sum()
        for leaf in tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad
    ]
    return torch.stack([part.float() for part in parts]).sum() if parts else None
