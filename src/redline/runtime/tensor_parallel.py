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
2. Hugging Face Llama, Mistral and Qwen2 (``LlamaModel``'s module names: ``self_attn.q_proj``...), BERT
   (``BertModel``'s) and GPT-2 (``GPT2Model``'s), with or without a head around them.

A projection that packs several side by side (GPT-2's ``c_attn``, ``[q | k | v]``) is split per projection
(``PackedColwiseParallel``, a ``_StridedShard``): each rank computes its heads of each, and the gathered
weight (``full_tensor()``) is laid out as the model's. Beside FSDP over data ranks, FSDP2 must not cut the
packed dimension again: it would cut a rank's ``[q_r | k_r | v_r]`` in contiguous pieces across the
projections, a layout no DTensor placement describes (``full_tensor()`` came back out of order), so
``fsdp_layout`` shards such a parameter along another dimension, or, a 1-D bias, leaves it whole on each
data rank (``average_gradients``). DCP refuses ``_StridedShard`` placements; the checkpoint saves each
packed parameter as its projections, plain shards (``checkpoint.py``). GPT-2's ``Conv1D`` stores its weight
transposed: its own styles shard the other dimension.

Attention heads, key/value heads and the vocabulary must divide by the degree: checked, one line, before
anything is sharded. The logits come back whole on every rank (the head's output all-gathered), so the
user's loss runs unchanged: loss parallelism would need the loss computed inside ``loss_parallel()``, which
is the user's code.

Sequence parallelism (``sequence_parallel``), Megatron's as torchtitan lays it out, where the model's plan
has it: Llama's and GPT-2's family plans and a model's own ``redline_tp_plan(degree, sequence_parallel)``. Between the
projections each rank holds its rows of the sequence (the residual stream a DTensor sharded along it, so a
model reading the sequence length from it reads the whole one); the norms compute on those rows, the
attention's and MLP's inputs are all-gathered, the row-wise projections reduce-scatter. BERT's plan does
not have it (post-norm blocks, a pooler and a head transform outside the plan would each need a layout):
the run warns and holds the activations whole (see ``apply_tp``).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from redline.errors import BadInput
from redline.workload.split_marks import TensorSplitPlan
from redline.workload.structure import module_prefix

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


def _is_conv1d(layer: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's projections): a linear layer whose weight is stored (in, out), the
    transpose of ``nn.Linear``'s."""
    return type(layer).__name__ == "Conv1D" and type(layer).__module__.startswith("transformers.")


class PackedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for an ``nn.Linear`` or a ``Conv1D`` whose output packs ``packed`` projections
    side by side (a fused ``[q | k | v]``: ``packed=3``): each rank holds its share of each projection, its
    heads of q, of k and of v (``_StridedShard``), not one third of the packed output. Its output is its
    own ``[q_r | k_r | v_r]``, local; the gathered weight (``full_tensor()``) keeps the model's layout.
    ``packed=1`` is ``ColwiseParallel`` for a ``Conv1D`` too."""

    def __init__(
        self, *, packed: int = 1, input_layouts: Placement | None = None, use_local_output: bool = True
    ) -> None:
        super().__init__(input_layouts=input_layouts, use_local_output=use_local_output)
        self.packed = packed

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) and not _is_conv1d(module):
            raise NotImplementedError(f"PackedColwiseParallel takes nn.Linear and Conv1D, not {type(module).__name__}")
        prepare_input = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        return distribute_module(module, device_mesh, self._partition, prepare_input, self._prepare_output)

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            dim = 1 if _is_conv1d(module) and param_name == "weight" else 0  # the outputs' dimension
            placement = Shard(dim) if self.packed == 1 else _StridedShard(dim, split_factor=self.packed)
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _prepare_output(self, module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
        # the output stays sharded as the weight is: a redistribution to Shard(-1) would mix the projections
        return outputs.to_local() if self.use_local_output else outputs


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a ``Conv1D``: its weight's inputs are its first dimension, the bias whole."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            raise NotImplementedError(f"Conv1DRowwiseParallel takes Conv1D, not {type(module).__name__}")
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d,
            partial(self._prepare_input_fn, self.input_layouts, (Shard(-1),)),  # the inputs' shares
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def _partition_conv1d(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, placement in (("weight", Shard(0)), ("bias", Replicate())):
            param = getattr(module, param_name)
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class LocalCounts(ParallelStyle):
    """Shards nothing: divides a module's counts of what the ranks split by the degree, for a module that
    computes with them (GPT-2's attention splits its packed output by ``split_size``, the width of q)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            setattr(module, name, getattr(module, name) // device_mesh.size())
        return module


def llama_plan(model: nn.Module, base: str, *, sequence_parallel: bool = False) -> TpPlan:
    """Llama, Mistral, Qwen2 (``LlamaModel``'s names under ``base``): q/k/v and gate/up column-wise, o and down
    row-wise, the embedding vocabulary-sharded. Attention reshapes with ``-1`` heads and keeps only the ratio of
    query to key/value heads, which the split leaves as it is.

    Under sequence parallelism (Megatron's, as torchtitan lays it out) the residual stream is split along
    the sequence between the projections: the norms compute on their rank's rows, the attention's and the
    MLP's inputs are gathered whole, o and down reduce-scatter their sums back to rows, the embedding hands
    rows out, the head gathers them. The stream stays a DTensor, of the whole sequence's shape: LlamaModel
    takes the positions and the causal mask from its length."""
    layer = f"{base}layers.*."
    stream = _stream_layout(sequence_parallel)
    plan = {
        f"{base}embed_tokens": RowwiseParallel(input_layouts=Replicate(), **stream),
        f"{layer}self_attn.q_proj": ColwiseParallel(),
        f"{layer}self_attn.k_proj": ColwiseParallel(),
        f"{layer}self_attn.v_proj": ColwiseParallel(),
        f"{layer}self_attn.o_proj": RowwiseParallel(**stream),
        f"{layer}mlp.gate_proj": ColwiseParallel(),
        f"{layer}mlp.up_proj": ColwiseParallel(),
        f"{layer}mlp.down_proj": RowwiseParallel(**stream),
    } | _head(model, "lm_head", sequence_parallel=sequence_parallel)
    if sequence_parallel:
        plan |= {
            f"{base}norm": SequenceParallel(),
            f"{layer}input_layernorm": SequenceParallel(),
            f"{layer}post_attention_layernorm": SequenceParallel(),
            # the decoder layer hands the attention its input by keyword, the MLP by position
            f"{layer}self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
            f"{layer}mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        }
    return plan


def _stream_layout(sequence_parallel: bool) -> dict[str, Any]:
    """How a layer writing the residual stream leaves it: whole on every rank, a plain tensor; under sequence
    parallelism its rows split over the ranks (a reduce-scatter after a row-wise layer), a DTensor."""
    if sequence_parallel:
        return {"output_layouts": Shard(1), "use_local_output": False}
    return {"output_layouts": Replicate()}


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


def gpt2_plan(model: nn.Module, base: str, *, sequence_parallel: bool = False) -> TpPlan:
    """GPT-2 (``GPT2Model``'s names under ``base``): the packed q/k/v projection column-wise by projection
    (each rank its heads of each), its attention told the local width of q, k and v; ``mlp.c_fc``
    column-wise; the ``c_proj``s row-wise; the token embedding vocabulary-sharded (the position embedding
    and the norms stay whole). The projections are ``Conv1D``s; attention reshapes with ``-1`` heads.

    Under sequence parallelism as Llama's (``llama_plan``): ``c_attn`` and ``c_fc``, each the only reader
    of its block's input, gather it; the position embedding hands each rank its rows."""
    layer = f"{base}h.*."
    stream = _stream_layout(sequence_parallel)
    rows = Shard(1) if sequence_parallel else None
    plan = {
        f"{base}wte": RowwiseParallel(input_layouts=Replicate(), **stream),
        f"{layer}attn": LocalCounts("split_size"),
        f"{layer}attn.c_attn": PackedColwiseParallel(packed=3, input_layouts=rows),
        f"{layer}attn.c_proj": Conv1DRowwiseParallel(**stream),
        f"{layer}mlp.c_fc": PackedColwiseParallel(input_layouts=rows),
        f"{layer}mlp.c_proj": Conv1DRowwiseParallel(**stream),
    } | _head(model, "lm_head", sequence_parallel=sequence_parallel)
    if sequence_parallel:
        plan |= {
            f"{base}wpe": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
            ),
            f"{base}ln_f": SequenceParallel(),
            f"{layer}ln_1": SequenceParallel(),
            f"{layer}ln_2": SequenceParallel(),
        }
    return plan


def _head(model: nn.Module, path: str, *, sequence_parallel: bool = False) -> TpPlan:
    """The output head at ``path``, where the model has one: vocabulary-sharded, the logits gathered whole
    (its input gathered first under sequence parallelism)."""
    found = dict(model.named_modules()).get(path)
    if not isinstance(found, nn.Linear):
        return {}
    rows = Shard(1) if sequence_parallel else Replicate()
    return {path: ColwiseParallel(input_layouts=rows, output_layouts=Replicate())}


@dataclass(frozen=True)
class Family:
    """A family of models found by their module names."""

    name: str
    names: tuple[str, ...]  # the module names that tell it, under one prefix ("model." in LlamaForCausalLM)
    build: Callable[..., TpPlan]  # (model, prefix) -> its plan; sequence_parallel=True where it has that
    sequence_parallel: bool  # whether its plan lays out sequence parallelism


FAMILIES = (
    Family(
        "Llama/Mistral/Qwen2", ("embed_tokens", "layers.0.self_attn.q_proj", "layers.0.mlp.gate_proj"), llama_plan, True
    ),
    Family("BERT", ("embeddings.word_embeddings", "encoder.layer.0.attention.self.query"), bert_plan, False),
    Family("GPT-2", ("wte", "wpe", "h.0.attn.c_attn", "h.0.mlp.c_fc"), gpt2_plan, True),
)


def _family(model: nn.Module) -> tuple[Family, str] | None:
    """The model's family and the prefix of its names; None if it is of none redline knows."""
    for family in FAMILIES:
        base = module_prefix(model, family.names)
        if base is not None:
            return family, base
    return None


def has_sequence_parallel(model: nn.Module) -> bool:
    """Whether the model's plan lays out sequence parallelism: its own ``redline_tp_plan`` method taking a
    ``sequence_parallel`` keyword, or its family's (Llama's and GPT-2's; not BERT's)."""
    own = getattr(model, "redline_tp_plan", None)
    if own is not None:
        return callable(own) and "sequence_parallel" in inspect.signature(own).parameters
    found = _family(model)
    return found is not None and found[0].sequence_parallel


def find_plan(model: nn.Module, degree: int, *, sequence_parallel: bool = False) -> TpPlan:
    """The model's tensor-parallel plan (its own ``redline_tp_plan``, else its family's), with sequence
    parallelism where ``sequence_parallel`` (the model's plan must have it: ``has_sequence_parallel``);
    BadInput naming what a model can do where there is none."""
    if sequence_parallel and not has_sequence_parallel(model):
        raise BadInput(f"the tensor-parallel plan for {type(model).__name__} lays out no sequence parallelism")
    extra = {"sequence_parallel": True} if sequence_parallel else {}
    own = getattr(model, "redline_tp_plan", None)
    if own is not None:
        plan = own(degree, **extra) if callable(own) else own
        if not isinstance(plan, dict) or not plan:
            raise BadInput(f"{type(model).__name__}.redline_tp_plan gave {plan!r}: give {{module path: ParallelStyle}}")
        return plan
    found = _family(model)
    if found is not None:
        family, base = found
        return family.build(model, base, **extra)
    known = ", ".join(family.name for family in FAMILIES)
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
    for key, _, layer in _planned_layers(model, plan):
        style = plan[key]
        dim = _sharded_dim(layer, style)
        if dim is None:
            continue
        # a Linear's, an Embedding's or a Conv1D's Parameter: _sharded_dim names a dimension of no other layer
        weight = cast(torch.Tensor, layer.weight)
        packed = getattr(style, "packed", 1)  # each packed projection is split on its own
        if weight.shape[dim] % (packed * degree):
            size = weight.shape[dim]
            what = f"of {size}" if packed == 1 else f"{packed} packed projections of {size // packed}"
            raise BadInput(
                f"tensor parallelism over {degree} ranks splits {key} ({type(layer).__name__} "
                f"{tuple(weight.shape)}) along dimension {dim}, {what}: not a multiple of {degree}"
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard ``model``'s layers over ``tp_mesh`` in place, by its plan (``find_plan``), after checking the
    split. Its parameters become DTensors (an optimizer must be built on them afterwards); a weight tied to
    another before (an embedding used as the output head) is tied again after. ``sequence_parallel`` is
    applied where the model's plan has it (``has_sequence_parallel``); elsewhere (BERT, a model's own
    plan without the keyword) a warning says the activations are held whole on each rank of a group, and
    the plan's memory figures, which count them sharded, do not hold."""
    degree = tp_mesh.size()
    applied = sequence_parallel and has_sequence_parallel(model)
    plan = find_plan(model, degree, sequence_parallel=applied)
    check_divisible(model, plan, degree)
    if sequence_parallel and not applied and tp_mesh.get_rank() == 0:
        log.warning(
            "the plan asks for sequence parallelism, which the runtime does not apply yet to %s: each "
            "tensor-parallel rank holds its group's activations whole, more than the plan's memory figures count",
            type(model).__name__,
        )
    tied = _tied_weights(model)
    parallelize_module(model, tp_mesh, plan)
    for group in tied:
        _tie_again(group)


def _planned_layers(model: nn.Module, plan: TpPlan) -> list[tuple[str, str, nn.Module]]:
    """(plan key, path, module) for every module a plan key names (keys are fnmatch patterns per path part)."""
    found = []
    for name, module in model.named_modules():
        for key in plan:
            parts, patterns = name.split("."), key.split(".")
            if len(parts) == len(patterns) and all(fnmatch(p, q) for p, q in zip(parts, patterns, strict=True)):
                found.append((key, name, module))
    return found


def _sharded_dim(layer: nn.Module, style: ParallelStyle) -> int | None:
    """The weight dimension a style splits: column-wise a layer's outputs (an Embedding's width), row-wise
    its inputs (an Embedding's vocabulary). A Linear stores its weight (out, in), an Embedding and a Conv1D
    (in, out)."""
    if isinstance(layer, nn.Linear):
        outputs, inputs = 0, 1
    elif isinstance(layer, nn.Embedding) or _is_conv1d(layer):
        outputs, inputs = 1, 0
    else:
        return None
    if isinstance(style, ColwiseParallel):
        return outputs
    if isinstance(style, RowwiseParallel):
        return inputs
    return None


def tensor_split_plan(model: nn.Module) -> TensorSplitPlan | None:
    """What the model's tensor-parallel plan splits, for the planner's count of what a rank holds (``redline plan``
    gives this to the tracer), by name:

    - ``params``: a column-wise layer's weight and bias, a row-wise layer's weight (its bias is added once the
      partial sums are reduced, so every rank holds it whole), nothing of the layers the plan leaves alone
      (norms, a position embedding);
    - ``replicated_beside_fsdp``: of those, the ones FSDP2 leaves whole on each data rank beside it
      (``fsdp_layout``): a packed projection's 1-D bias (GPT-2's ``c_attn``), which has no dimension but the
      packed one to shard. (A packed ``nn.Linear`` weight whose input width the data degree does not divide is
      left whole too; which degree that is, is not known here, and the count leaves it out.);
    - ``columns``: the column-wise layers whose output stays split (each rank its share of the features);
    - ``rows``: the row-wise layers, whose output is the sum over the ranks.

    None for a model with no plan. Which layers split does not depend on the degree; a model's own
    ``redline_tp_plan`` is asked for two ranks."""
    if getattr(model, "redline_tp_plan", None) is None and _family(model) is None:
        return None
    plan = find_plan(model, 2)
    params, whole, columns, rows = set(), set(), set(), set()
    for key, path, layer in _planned_layers(model, plan):
        style = plan[key]
        if _sharded_dim(layer, style) is None:
            continue
        kept = ("weight",) if isinstance(style, RowwiseParallel) else ("weight", "bias")
        for name, param in layer.named_parameters(recurse=False):
            if name in kept:
                params.add(f"{path}.{name}")
                if getattr(style, "packed", 1) > 1 and param.ndim == 1:
                    whole.add(f"{path}.{name}")
        if isinstance(style, ColwiseParallel) and not any(isinstance(o, Replicate) for o in style.output_layouts):
            columns.add(path)
        elif isinstance(style, RowwiseParallel):
            rows.add(path)
    return TensorSplitPlan(params=params, replicated_beside_fsdp=whole, columns=columns, rows=rows)


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


def packed_dim(tensor: Any) -> tuple[int, int] | None:
    """``(dim, packed)`` of a DTensor sharded per packed projection (``PackedColwiseParallel``: a
    ``_StridedShard`` of ``packed`` projections along ``dim``); None for any other tensor.

    FSDP2 writes ``_StridedShard`` too, on the data ranks' mesh dimension, where a later (tensor-parallel)
    mesh dimension shards the same tensor dimension after it; a packing is the last to shard its dimension."""
    found = _packing(tensor)
    return None if found is None else (found[1].dim, _split_factor(found[1]))


def _packing(tensor: Any) -> tuple[int, _StridedShard] | None:
    """The mesh dimension and placement of a packed DTensor's packing (``packed_dim``)."""
    placements = tuple(getattr(tensor, "placements", ()))
    for index, placement in enumerate(placements):
        later = placements[index + 1 :]
        if isinstance(placement, _StridedShard) and not any(_shards(p, placement.dim) for p in later):
            return index, placement
    return None


def _split_factor(packing: _StridedShard) -> int:
    """The packing's projections: an int (a SymInt only while torch.compile traces a view of one, and the
    packings here are made eagerly, from ``PackedColwiseParallel.packed`` or by FSDP2)."""
    return int(packing.split_factor)


def _shards(placement: Placement, dim: int) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim


def fsdp_layout(
    model: nn.Module, dp_mesh: DeviceMesh
) -> tuple[Callable[[nn.Parameter], Shard | None], set[nn.Parameter]]:
    """How FSDP2 shards ``model`` over the data ranks ``dp_mesh`` beside tensor parallelism: its
    ``shard_placement_fn``, and the parameters it must leave alone (``ignored_params``).

    A packed parameter (``packed_dim``) is sharded along another dimension (FSDP2 takes dimension 0 cut
    unevenly, any other only where it divides by the data ranks); one without such a dimension (GPT-2's
    1-D ``c_attn`` bias, 3 x hidden numbers) is left out of FSDP2, whole on each data rank, its gradient
    averaged over them by ``average_gradients``. FSDP2's default would cut the
    packed dimension again: each data rank a contiguous piece of the tensor-parallel rank's
    ``[q_r | k_r | v_r]``, pieces that straddle the projections. Training is right either way, but no
    DTensor placement describes those pieces: FSDP2 labels them ``_StridedShard`` over the data ranks,
    ``full_tensor()`` gathers them out of order, and the checkpoint cannot split them into projections.
    FSDP2 (torch 2.13) cannot replicate one parameter over its mesh while it shards the others.
    Every other parameter is sharded as FSDP2 does (dimension 0)."""
    size = dp_mesh.size()

    def other_dim(param: nn.Parameter) -> int | None:
        found = packed_dim(param)
        if found is None:
            return None
        dims = [d for d in range(param.ndim) if d != found[0] and (d == 0 or param.shape[d] % size == 0)]
        return dims[0] if dims else None

    def place(param: nn.Parameter) -> Shard | None:
        dim = other_dim(param)
        return None if dim is None else Shard(dim)

    ignored = {p for p in model.parameters() if packed_dim(p) is not None and other_dim(p) is None}
    return place, ignored


def average_gradients(params: set[nn.Parameter], dp_mesh: DeviceMesh) -> None:
    """Average each of ``params``' gradients over the data ranks ``dp_mesh`` as it is accumulated (what
    FSDP2 does for the parameters it holds; these are the ones ``fsdp_layout`` leaves out of it). At every
    backward, also those FSDP2 runs without reducing (accumulation): each rank's gradient is then the
    average of the reduced earlier ones, alike on every rank, plus its own, so the mean is right."""
    group = dp_mesh.get_group()

    def hook(param: torch.Tensor) -> None:
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if grad is None:  # torch calls the hook once a gradient is accumulated into .grad
            raise RuntimeError("a post-accumulate-grad hook ran on a parameter without a gradient")
        torch.distributed.all_reduce(grad, group=group)
        grad.div_(dp_mesh.size())

    for param in params:
        param.register_post_accumulate_grad_hook(hook)


def split_packed(tensor: DTensor) -> list[DTensor]:
    """A packed parameter (or optimizer state, ``packed_dim``) as its projections, each a DTensor of plain
    ``Shard`` placements on the same mesh whose local tensor is a view of this rank's share of that projection:
    what DCP can save (it refuses ``_StridedShard``) and reshard, with no gather. Undone by ``join_packed``.
    The packed dimension must be sharded by nothing else (``fsdp_layout`` sees to that beside FSDP2)."""
    found = _packing(tensor)
    if found is None:
        raise ValueError(f"not a packed DTensor: {getattr(tensor, 'placements', type(tensor).__name__)}")
    index, packing = found
    dim, packed = packing.dim, _split_factor(packing)
    placements = list(tensor.placements)
    if any(_shards(p, dim) for i, p in enumerate(placements) if i != index):
        raise ValueError(f"the packed dimension {dim} is sharded twice ({tensor.placements}): cannot split it")
    placements[index] = Shard(dim)
    shape = list(tensor.shape)
    shape[dim] //= packed
    parts = tensor.to_local().chunk(packed, dim=dim)
    size, stride = torch.Size(shape), torch.empty(shape, device="meta").stride()
    mesh = tensor.device_mesh
    return [DTensor.from_local(p, mesh, placements, run_check=False, shape=size, stride=stride) for p in parts]


def join_packed(tensor: DTensor, parts: list[DTensor]) -> None:
    """Write ``parts`` (``split_packed``'s, as loaded) back into the packed ``tensor``'s local share."""
    found = packed_dim(tensor)
    if found is None:
        raise ValueError(f"not a packed DTensor: {getattr(tensor, 'placements', type(tensor).__name__)}")
    dim, _ = found
    tensor.to_local().copy_(torch.cat([part.to_local() for part in parts], dim=dim))


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
