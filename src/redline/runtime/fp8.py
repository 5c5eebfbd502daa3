"""fp8 training: the model's linear layers multiply in float8 through torchao's ``convert_to_float8_training``
(dynamic per-tensor scales: e4m3 operands forward, e5m2 gradients), the rest of the step in bf16 autocast (and
bf16 FSDP2 parameters), as torchtitan trains Llama 3 in fp8.

Where it runs: an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell: the ones with fp8 tensor
cores), with torchao installed (torchao: the ``fp8`` extra). ``unavailable`` says why not otherwise, for
``config.check_runnable``, the one check that ``redline run`` applies before any rank starts and ``prepare()``
on the rank's own device. Not beside tensor parallelism: torchao's float8 tensor-parallel styles
(``Float8ColwiseParallel``...) are not in ``tensor_parallel.py``'s plans, and the plain styles would shard a
``Float8Linear`` as a bf16 layer.

Which layers (``fp8_filter``, torchtitan's filter): every ``nn.Linear`` whose two dimensions are multiples of 16
(what the fp8 GEMM requires), except the output layer, whose logits a float8 product would coarsen where the
loss is most sensitive (torchtitan keeps Llama's ``output`` in bf16 for that). ``prepare()`` converts before any
parallelism wraps the layers (torchtitan's order: the converters, then ``parallelize``); the conversion keeps each
layer's parameters, so a ready optimizer still steps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from redline.capability import is_available
from redline.plan.strategy import Strategy
from redline.workload.structure import find_blocks

log = logging.getLogger("redline.runtime")

# fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0, 12.0); an A100 (8.0) has none
MIN_CAPABILITY = (8, 9)
# the fp8 GEMM (cuBLASLt's _scaled_mm) needs both dimensions of each operand to be multiples of 16
DIM_MULTIPLE = 16
WHY_BF16 = "plan with --precision bf16"

ModuleFilter = Callable[[nn.Module, str], bool]


def unavailable(strategy: Strategy, device: torch.device | None = None) -> str | None:
    """Why an fp8 ``strategy`` cannot train here, in one sentence; None where it can. ``device``: the rank's GPU
    (``prepare()``); None: every GPU this process sees (the launcher, before the ranks pick theirs). Reads the
    devices' properties only: no memory is allocated on them."""
    if strategy.tensor > 1:
        return (
            "fp8 training does not combine with tensor parallelism yet (torchao's float8 tensor-parallel styles "
            f"are not wired in): {WHY_BF16}, or without tensor parallelism"
        )
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return (
            f"fp8 training needs an NVIDIA GPU of compute capability {_cc(MIN_CAPABILITY)} or newer (fp8 tensor "
            f"cores), and this machine has none: {WHY_BF16}"
        )
    indices = [device.index or 0] if device is not None else range(torch.cuda.device_count())
    for index in indices:
        capability = torch.cuda.get_device_capability(index)
        if capability < MIN_CAPABILITY:
            return (
                f"fp8 training needs compute capability {_cc(MIN_CAPABILITY)} or newer (fp8 tensor cores), and "
                f"{torch.cuda.get_device_name(index)} is {_cc(capability)}: {WHY_BF16}"
            )
    if not is_available("torchao"):
        return (
            "fp8 training runs through torchao, which is not installed: pip install torchao (the fp8 extra), "
            f"or {WHY_BF16}"
        )
    return None


def output_layers(model: nn.Module) -> set[nn.Module]:
    """The model's output layers, kept in bf16: a Hugging Face model's output embeddings, any linear layer
    whose weight is an embedding's (a tied head), and the last linear layer registered outside the model's
    repeated blocks (``head``, ``output``, a classifier; a model without a head loses one layer's speed-up,
    no accuracy)."""
    heads: set[nn.Module] = set()
    get_output = getattr(model, "get_output_embeddings", None)
    if callable(get_output) and isinstance(found := get_output(), nn.Linear):
        heads.add(found)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads.update(m for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings)
    # (a stack of bare linear layers is no model of blocks: its last layer is its output)
    blocks = [block for _, block in find_blocks(model) if not isinstance(block, nn.Linear)]
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    outside = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in in_blocks]
    if outside:
        heads.add(outside[-1])
    return heads


def fp8_filter(model: nn.Module) -> ModuleFilter:
    """``convert_to_float8_training``'s ``module_filter_fn`` for ``model``: True for the linear layers that
    compute in float8 (the module docstring says which)."""
    heads = output_layers(model)

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or module in heads:
            return False
        out_features, in_features = module.weight.shape
        return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0

    return convert


def apply_fp8(model: nn.Module, *, rank: int = 0) -> nn.Module:
    """``model``'s linear layers that ``fp8_filter`` picks made torchao ``Float8Linear``s, in place (the same
    parameters); the model (a new one only where the model itself was such a layer). Says how many, once."""
    from torchao.float8 import convert_to_float8_training

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    picked = fp8_filter(model)
    names = {id(m): name for name, m in model.named_modules()}
    chosen = sum(picked(m, names[id(m)]) for m in linears)
    model = convert_to_float8_training(model, module_filter_fn=picked)
    if rank == 0:
        if chosen:
            log.warning(
                "fp8: %d of %d linear layers multiply in float8 (torchao); the output layer and layers whose "
                "dimensions are not multiples of %d stay in bf16",
                chosen,
                len(linears),
                DIM_MULTIPLE,
            )
        else:
            log.warning(
                "fp8: none of the model's %d linear layers can multiply in float8 (the output layer stays bf16, "
                "and fp8 needs dimensions that are multiples of %d): the step runs in bf16",
                len(linears),
                DIM_MULTIPLE,
            )
    return model


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"
