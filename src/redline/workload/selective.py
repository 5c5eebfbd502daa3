"""Selective activation checkpointing: which operators' outputs a checkpointed block keeps for its backward.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 5) keep a
block's activations but recompute its attention core (QK^T, softmax, its dropout and the attention over V): the
s x s tensors, most of the memory at long sequences and a few percent of the FLOPs. PyTorch says this per
operator (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): a block run under
``torch.utils.checkpoint.checkpoint`` with this policy keeps its input and the outputs of ``SAVED_OPS``, and its
backward recomputes everything else from them. ``SAVED_OPS`` are:

- the linear layers' matrix multiplications (2-D ``mm``/``addmm``, and fp8's ``_scaled_mm``): costly to redo,
  and what the backward needs most;
- the fused attention kernels (flash, memory-efficient, cuDNN, and the CPU's flash kernel): they keep no s x s
  tensor, only their output and a log-sum-exp, which is the attention output Korthikanti count as kept; keeping
  it means the backward reruns no attention at all (torchtitan keeps them too);
- under sequence parallelism, the reduce-scatter that ends a row-parallel layer, so that the recomputation
  repeats no collective (as torchtitan does).

Recomputed: an unfused attention core (its two ``bmm`` products, the mask, softmax and dropout over the s x s
scores; a linear layer's batched input reaches the dispatcher as one ``mm``, so ``bmm`` in a block is the core),
and the elementwise operators (norms, activations, dropout, casts), which cost memory bandwidth to redo, not
matmul FLOPs.

The tracer measures what a block keeps under this policy (``workload.measured_memory``) and the runtime
checkpoints with it: both import it from here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts


def _saved_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}
    ops |= {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    if torch.distributed.is_available():
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset(ops)


# the operators whose outputs a block under selective checkpointing keeps; it recomputes all others
SAVED_OPS: frozenset[Any] = _saved_ops()


def selective_checkpoint_context() -> tuple[Any, Any]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``) for selective
    checkpointing: save ``SAVED_OPS``' outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(list(SAVED_OPS))
