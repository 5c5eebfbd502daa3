"""Tensor parallelism (Megatron-style) over a model's layers: ``apply_tp`` shards each attention and MLP
block's projections over the tensor-parallel ranks with ``parallelize_module`` (torchtitan's
``parallelize_llama`` shape): the first projection of a pair column-wise (each rank computes its share of
the heads or of the hidden units), the second row-wise (the shares' partial sums all-reduced), the token
embedding and the output head vocabulary-sharded.

Where the plan comes from, first match wins:

1. the model's own ``redline_tp_plan`` (a method taking the tensor-parallel degree, or an attribute): the
   ``parallelize_module`` plan, ``{module path or fnmatch pattern: ParallelStyle}``. A model declares its plan
   this way when its layers do not follow a known family (``examples/train_gpt.py`` does). Its attention must
   compute with the heads its rank holds: reshape with ``-1`` heads, or store the local count;
2. Hugging Face Llama, Mistral and Qwen2 (``LlamaModel``'s module names: ``self_attn.q_proj``...), and
   BERT (``BertModel``'s), with or without a head around them.

Attention heads, key/value heads and the vocabulary must divide by the degree: checked, one line, before
anything is sharded. The logits come back whole on every rank (the head's output all-gathered), so the
user's loss runs unchanged: loss parallelism would need the loss computed inside ``loss_parallel()``, which
is the user's code. Sequence parallelism is not applied (see ``apply_tp``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from redline.errors import BadInput

log = logging.getLogger("redline.runtime")

TpPlan = dict[str, ParallelStyle]

# the counts tensor parallelism splits over its ranks, as a model's config (Hugging Face's names) or its
# modules (the names attention modules store their head counts under) hold them
SPLIT_COUNTS = (
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "n_head",
    "heads",
)


def llama_plan(model: nn.Module, base: str) -> TpPlan:
    """Llama, Mistral, Qwen2 (``LlamaModel``'s names under ``base``): q/k/v and gate/up column-wise, o and down
    row-wise, the embedding vocabulary-sharded. Attention reshapes with ``-1`` heads and keeps only the ratio of
    query to key/value heads, which the split leaves as it is."""
    layer = f"{base}layers.*."
    return {
        f"{base}embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        f"{layer}self_attn.q_proj": ColwiseParallel(),
        f"{layer}self_attn.k_proj": ColwiseParallel(),
        f"{layer}self_attn.v_proj": ColwiseParallel(),
        f"{layer}self_attn.o_proj": RowwiseParallel(),
        f"{layer}mlp.gate_proj": ColwiseParallel(),
        f"{layer}mlp.up_proj": ColwiseParallel(),
        f"{layer}mlp.down_proj": RowwiseParallel(),
    } | _head(model, "lm_head")


def bert_plan(model: nn.Module, base: str) -> TpPlan:
    """BERT (``BertModel``'s names under ``base``): query/key/value and the intermediate layer column-wise,
    the attention's and the layer's output row-wise, the word embedding vocabulary-sharded (position and type
    embeddings, norms and the pooler stay whole); a masked-LM head's decoder too. Attention reshapes with
    ``-1`` heads."""
    layer = f"{base}encoder.layer.*."
    return {
        f"{base}embeddings.word_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        f"{layer}attention.self.query": ColwiseParallel(),
        f"{layer}attention.self.key": ColwiseParallel(),
        f"{layer}attention.self.value": ColwiseParallel(),
        f"{layer}attention.output.dense": RowwiseParallel(),
        f"{layer}intermediate.dense": ColwiseParallel(),
        f"{layer}output.dense": RowwiseParallel(),
    } | _head(model, "cls.predictions.decoder")


def _head(model: nn.Module, path: str) -> TpPlan:
    """The output head at ``path``, where the model has one: vocabulary-sharded, the logits gathered whole."""
    found = dict(model.named_modules()).get(path)
    return {path: ColwiseParallel(output_layouts=Replicate())} if isinstance(found, nn.Linear) else {}


# the families found by their module names: what the family is, the names that tell it (each under one
# prefix, "model." in LlamaForCausalLM, "" in LlamaModel), its plan
FAMILIES: tuple[tuple[str, tuple[str, ...], Callable[[nn.Module, str], TpPlan]], ...] = (
    ("Llama/Mistral/Qwen2", ("embed_tokens", "layers.0.self_attn.q_proj", "layers.0.mlp.gate_proj"), llama_plan),
    ("BERT", ("embeddings.word_embeddings", "encoder.layer.0.attention.self.query"), bert_plan),
)


def _base(model: nn.Module, names: tuple[str, ...]) -> str | None:
    """The prefix under which the model has every one of ``names``; None if it has not."""
    paths = {name for name, _ in model.named_modules()}
    for path in paths:
        if path == names[0] or path.endswith("." + names[0]):
            base = path.removesuffix(names[0])
            if all(base + name in paths for name in names):
                return base
    return None


def find_plan(model: nn.Module, degree: int) -> TpPlan:
    """The model's tensor-parallel plan (its own ``redline_tp_plan``, else its family's); BadInput naming
    what a model can do where there is none."""
    own = getattr(model, "redline_tp_plan", None)
    if own is not None:
        plan = own(degree) if callable(own) else own
        if not isinstance(plan, dict) or not plan:
            raise BadInput(f"{type(model).__name__}.redline_tp_plan gave {plan!r}: give {{module path: ParallelStyle}}")
        return plan
    for _, names, build in FAMILIES:
        base = _base(model, names)
        if base is not None:
            return build(model, base)
    known = ", ".join(family for family, _, _ in FAMILIES)
    raise BadInput(
        f"no tensor-parallel plan for {type(model).__name__}: redline knows {known}; give the model a "
        "redline_tp_plan(degree) method returning its parallelize_module plan, or plan with --tp 1"
    )


def check_divisible(model: nn.Module, plan: TpPlan, degree: int) -> None:
    """Every count the split divides (heads, key/value heads, vocabulary, the sharded dimension of each
    planned layer) is a multiple of ``degree``: one line naming the first that is not."""
    holders = [getattr(model, "config", None), *model.modules()]
    for holder, name in itertools.product(holders, SPLIT_COUNTS):
        count = getattr(holder, name, None)
        if isinstance(count, int) and not isinstance(count, bool) and count % degree:
            raise BadInput(
                f"tensor parallelism over {degree} ranks splits {name} over them, and "
                f"{type(holder).__name__} has {count}: plan with a --tp that divides {count}"
            )
    for path, layer in _planned_layers(model, plan):
        style = plan[path]
        dim = _sharded_dim(layer, style)
        if dim is not None and layer.weight.shape[dim] % degree:
            raise BadInput(
                f"tensor parallelism over {degree} ranks splits {path} ({type(layer).__name__} "
                f"{tuple(layer.weight.shape)}) along dimension {dim}, of {layer.weight.shape[dim]}: not a "
                f"multiple of {degree}"
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard ``model``'s layers over ``tp_mesh`` in place, by its plan (``find_plan``), after checking the
    split. Its parameters become DTensors (an optimizer must be built on them afterwards); a weight tied to
    another before (an embedding used as the output head) is tied again after. ``sequence_parallel`` is not
    applied: a block computes its sequence length from its input, which sequence parallelism would hand it
    a shard of; the activations are then held whole on each rank of a group, and the plan's memory figures,
    which count them sharded, are said not to hold."""
    degree = tp_mesh.size()
    plan = find_plan(model, degree)
    check_divisible(model, plan, degree)
    if sequence_parallel and tp_mesh.get_rank() == 0:
        log.warning(
            "the plan asks for sequence parallelism, which the runtime does not apply yet: each tensor-parallel "
            "rank holds its group's activations whole, more than the plan's memory figures count"
        )
    tied = _tied_weights(model)
    parallelize_module(model, tp_mesh, plan)
    for group in tied:
        _tie_again(group)


def _planned_layers(model: nn.Module, plan: TpPlan) -> list[tuple[str, nn.Module]]:
    """(plan key, module) for every module a plan key names (keys are fnmatch patterns per path part)."""
    found = []
    for name, module in model.named_modules():
        for key in plan:
            parts, patterns = name.split("."), key.split(".")
            if len(parts) == len(patterns) and all(fnmatch(p, q) for p, q in zip(parts, patterns, strict=True)):
                found.append((key, module))
    return found


def _sharded_dim(layer: nn.Module, style: ParallelStyle) -> int | None:
    """The weight dimension a style splits: column-wise a Linear's outputs, an Embedding's width; row-wise a
    Linear's inputs, an Embedding's vocabulary."""
    if not isinstance(layer, nn.Linear | nn.Embedding):
        return None
    if isinstance(style, ColwiseParallel):
        return 0 if isinstance(layer, nn.Linear) else 1
    if isinstance(style, RowwiseParallel):
        return 1 if isinstance(layer, nn.Linear) else 0
    return None


def _tied_weights(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, parameter name) places that share one parameter, per shared parameter: ties that
    ``parallelize_module`` would undo by making the planned places' parameters DTensors of their own."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]


def _tie_again(group: list[tuple[nn.Module, str]]) -> None:
    """Every place of a tie holds the same parameter again: the sharded one where the plan sharded one
    (an embedding and the head it is tied to are sharded alike, along the vocabulary)."""
    params = [getattr(module, name) for module, name in group]
    kept = next((p for p in params if isinstance(p, DTensor)), params[0])
    for module, name in group:
        setattr(module, name, kept)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (a DTensor's local shard), each shared parameter once."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        local: Any = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total
