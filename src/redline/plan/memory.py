"""Memory per GPU of one strategy, by component: pure arithmetic over a WorkloadProfile.

``allocated`` is what ``torch.cuda.max_memory_allocated`` reports at the peak of a training step (the
figure the GPU check compares with); ``device_total`` adds what the PyTorch allocator does not count or
keeps in reserve (fragmentation, the CUDA context, NCCL's buffers) and must fit in the GPU's memory. On a CPU
(``cpu=True``) the same tensors live in the process's RAM, with no CUDA context, NCCL or cuBLAS workspace.

The peak is the larger of two walks. Through the forward, each layer's rise (what it saves, its temporaries,
autocast's copies of its weights) comes on top of what the layers before it saved. Through the backward, from
the last layer, each layer's working set (a block's activation gradients and temporaries; under full
checkpointing also its recomputation; for a language model's head the loss's fp32 gradients, b x s x V twice;
for an embedding the dense gradient of its table) comes on top of what is still held, and as the layer
finishes its activations and autocast's copies of its weights go and its gradients arrive; the model's output,
which the loop holds, stays to the end. For a traced model the rise and a block's working set are measured
(``LayerProfile.forward_rise``, ``backward_working``); without a measurement a layer's rise is what it saves
and a block's working set all it saved, again (an upper bound: an encoder's needs a fifth of it).

An LM peaks in its loss's backward, or, with few tokens per step or its blocks checkpointed, in its embedding's:
a table tied to the head has then three fp32 gradients at once (the head's, the embedding's and their sum). A
CNN peaks part-way through its backward (big activations early, big parameters late), an encoder with a small
vocabulary in its last block's forward. Gradients exist from the start under DDP (its buckets hold every
gradient), gradient accumulation (the previous micro-batches' gradients wait for the next backward) and
pipelines. The optimizer is assumed fused (``fused=True``, which ``redline.prepare`` sets where the user left
the choice to PyTorch): it needs no parameter-sized temporaries. PyTorch's default Adam/AdamW on a GPU
(``foreach``) holds one more fp32 copy of what it steps while it runs (4 bytes a parameter), not counted here.

Checked against PyTorch's accounting of real steps (``tests/plan/test_plan_vs_memtracker.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from redline.plan import dtypes
from redline.plan.dtypes import activation_key, activation_value_bytes, block_input_bytes
from redline.plan.model_states import ZERO_STAGE, optimizer_state_bytes, pytorch_state_bytes
from redline.plan.pipeline_memory import (
    held_stage_outputs,
    in_flight_micro_batches,
    outside_blocks_micro_batches,
    pipeline_step_tensors,
)
from redline.plan.strategy import Strategy
from redline.units import MiB
from redline.workload.profile import LayerProfile, WorkloadProfile
from redline.workload.transformer import block_activation_bytes

DDP_BUCKET_BYTES = 25 * MiB  # DistributedDataParallel(bucket_cap_mb=25); two buckets in flight
FRAGMENTATION = 0.05  # the caching allocator's reserved-over-allocated margin for a steady training loop
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context and kernels with lazy loading (CUDA_MODULE_LOADING=LAZY)
NCCL_BUFFER_BYTES = 256 * MiB  # NCCL's own cudaMalloc'd channels/buffers, outside PyTorch's allocator
# PyTorch gives cuBLAS a workspace from its caching allocator, so it counts in memory_allocated from the first
# matmul on: 32 MiB on Hopper (its recommended size), 8 MiB elsewhere, one per handle and stream. Handles are per
# thread: the forward's (the training loop's thread) and the backward's (the autograd engine's device thread)
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
# bytes per parameter of a weight's compute copy: 16 bits, and under fp8 an 8-bit copy on top
COMPUTE_COPY_BYTES = {"fp32": 0, "bf16": 2, "fp16": 2, "fp8": 3}
LOSS_BACKWARD_BYTES = 4 + 4  # per token and vocabulary entry: log-softmax's fp32 output and input gradients
# what a training step makes around its loss and holds as the backward begins, beside what the loss saves: the loss
# itself, its share under accumulation and the running sum of the step's loss (``redline.prepare``'s), and autograd's
# seed gradient of the backward: four fp32 scalars. Under a pipeline the schedule keeps every micro-batch's loss
# for the step's mean instead, and the seed
STEP_SCALAR_BYTES = 4 * 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU (or, on a CPU, per process) on the busiest pipeline stage."""

    weights: float  # parameters as stored (fp32), after sharding
    grads: float  # fp32 gradients, after sharding
    optimizer: float  # optimizer states (and master weights), after sharding
    weight_copies: float  # 16-bit/fp8 copies of weights for compute: autocast's or FSDP's unsharded units
    activations: float  # saved for backward, all micro-batches in flight
    temporary: float  # the largest working set of one block's backward (with its recomputation), or the LM loss's
    table_grads: float  # an embedding's backward: the dense gradient of its tables (a tied one's three times)
    comm_buffers: float  # DDP buckets or FSDP's unsharded gradient of a unit
    workspaces: float  # cuBLAS's, from PyTorch's allocator (on a GPU; 0 on a CPU)
    fragmentation: float
    cuda_context: float  # 0 on a CPU
    nccl: float  # 0 on a CPU and on one GPU
    # the peak of the parts above as they come and go: compare with torch.cuda.max_memory_allocated()
    allocated: float
    grads_with_activations: bool  # DDP buckets or accumulation keep gradients through the forward pass

    @property
    def device_total(self) -> float:
        """What must fit in the GPU's memory (a CPU's: its RAM)."""
        return self.allocated + self.fragmentation + self.cuda_context + self.nccl

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"device_total": self.device_total}


@dataclass(frozen=True)
class Stage:
    """The layers one pipeline stage holds."""

    blocks: tuple[LayerProfile, ...]
    fixed: tuple[LayerProfile, ...]  # embedding on the first stage, head on the last
    index: int  # 0 for the first stage

    @property
    def params(self) -> int:
        return sum(layer.params for layer in (*self.blocks, *self.fixed))


def stages(profile: WorkloadProfile, pipeline: int) -> list[Stage]:
    """Blocks split as evenly as they go; the layers before the first block go with the first stage, the
    ones after the last block with the last. The remainder goes to the last stages: the first already
    holds the embedding and the most micro-batches in flight (Megatron likewise lightens the first)."""
    positions = [i for i, layer in enumerate(profile.layers) if layer.is_block]
    blocks = [profile.layers[i] for i in positions]
    first_block, head_start = (positions[0], positions[-1] + 1) if positions else (len(profile.layers),) * 2
    before, after = profile.layers[:first_block], profile.layers[head_start:]
    out: list[Stage] = []
    start = 0
    for index, count in enumerate(block_counts(len(blocks), pipeline)):
        fixed = (before if index == 0 else ()) + (after if index == pipeline - 1 else ())
        out.append(Stage(tuple(blocks[start : start + count]), tuple(fixed), index=index))
        start += count
    return out


def block_counts(blocks: int, stages: int) -> list[int]:
    """How many of ``blocks`` repeated blocks each of ``stages`` pipeline stages holds, first stage first: as
    even as they go, the remainder on the last stages (the runtime splits a model the same way)."""
    per_stage, extra = divmod(blocks, stages)
    return [per_stage + (1 if index >= stages - extra else 0) for index in range(stages)]


def optimizer_bytes(profile: WorkloadProfile, strategy: Strategy) -> float:
    """The strategy's optimizer state bytes per parameter, for this model's matrix shapes."""
    shape = profile.transformer
    return optimizer_state_bytes(
        strategy.optimizer, hidden=shape.hidden if shape else None, ffn_hidden=shape.ffn_hidden if shape else None
    )


def block_activation(profile: WorkloadProfile, block: LayerProfile, strategy: Strategy, *, decoder: bool) -> float:
    """Bytes one block saves for backward for one micro-batch, without checkpointing.

    Under tensor parallelism a block traced with the runtime's plan keeps what the trace found split, 1/t
    (``traced_split_activation``); otherwise transformers use Korthikanti's formula for the strategy's
    tensor/sequence parallelism; for a traced transformer the traced figure is scaled by the formula's ratio to its
    own unsplit value, so what the trace saw (the real attention kernel, extra saved tensors) carries over, less
    what each norm saves less of a narrower residual stream than the trace's (autocast alone's: ``plan.dtypes``).
    """
    key = activation_key(strategy)
    traced = traced_split_activation(block, strategy)
    shape = profile.transformer
    if shape is None:
        per_sample = block.activation_bytes_per_sample[key] if traced is None else traced
        return per_sample * strategy.micro_batch
    value, norm = activation_value_bytes(strategy), dtypes.norm_input_bytes(strategy, shape)
    t, sp, selective = strategy.tensor, strategy.sequence_parallel, strategy.checkpointing == "selective"

    def formula(t: int, sp: bool, selective: bool, norm: int) -> float:
        return block_activation_bytes(
            shape,
            profile.tokens_per_sample,
            bytes_per_value=value,
            norm_input_bytes=norm,  # what each norm saves of the residual stream
            tensor_parallel=t,
            sequence_parallel=sp,
            flash_attention=strategy.flash_attention,
            selective_recompute=selective,
            decoder=decoder,
        )

    split = formula(t, sp, selective, norm)
    if traced is None and profile.method != "traced":
        return split * strategy.micro_batch
    stream = dtypes.AUTOCAST_STREAM_BYTES  # the trace ran under autocast alone: its norms saved an fp32 stream
    as_traced = formula(t, sp, selective, stream)
    if traced is None:
        traced = block.activation_bytes_per_sample[key] * as_traced / formula(1, False, False, stream)
    return (traced - (as_traced - split)) * strategy.micro_batch


def traced_split_activation(block: LayerProfile, strategy: Strategy) -> float | None:
    """Bytes per sample a block saves on one tensor-parallel rank, where the tracer followed the runtime's plan
    through it (``workload.split_marks``): what its column-wise layers' outputs made, 1/t; their inputs, whole; the
    rest, on the residual stream, whole, or 1/t along the sequence under sequence parallelism. None without
    tensor parallelism, without the trace, or under Korthikanti's selective recomputation (the formula's)."""
    key = activation_key(strategy)
    t = strategy.tensor
    analytic_selective = strategy.checkpointing == "selective" and not recomputes_block(block, strategy)
    if t == 1 or key not in block.tensor_split_bytes_per_sample or analytic_selective:
        return None
    split = block.tensor_split_bytes_per_sample[key]
    gathered = block.gathered_bytes_per_sample.get(key, 0.0)
    stream = block.activation_bytes_per_sample[key] - split - gathered
    return split / t + gathered + stream / (t if strategy.sequence_parallel else 1)


def measured_bytes(
    lines: dict[str, tuple[tuple[float, float], ...]], layer: LayerProfile, strategy: Strategy, saved: float
) -> float | None:
    """A figure the tracer measured of ``layer`` as lines in the micro-batch (``LayerProfile.forward_rise``,
    ``backward_working``) at this micro-batch: its constant part split as the weights are, its per-sample part as
    the layer's saved activations (``saved`` bytes for this micro-batch and split). None where not measured."""
    key = activation_key(strategy)
    if not lines.get(key):
        return None
    per_sample = layer.activation_bytes_per_sample[key]
    # samples, in effect: the micro-batch, scaled as the saved activations are split
    samples = saved / per_sample if per_sample > 0 else strategy.micro_batch / strategy.tensor
    return max(0.0, max(c / strategy.tensor + x * samples for c, x in lines[key]))


def recomputes_block(layer: LayerProfile, strategy: Strategy) -> bool:
    """Whether a block's backward reruns its forward first: under full checkpointing, and under selective
    checkpointing where the tracer measured what ``workload.selective``'s per-operator policy keeps (the runtime's:
    it recomputes all but the matmuls). Korthikanti's analytic selective recomputes only the attention core,
    inside the backward."""
    if strategy.checkpointing == "full":
        return True
    return strategy.checkpointing == "selective" and activation_key(strategy) in layer.selective_bytes_per_sample


def covered_blocks(strategy: Strategy, stage: Stage) -> frozenset[str]:
    """The blocks of the stage that activation checkpointing covers: every ``checkpoint_every``-th block the rank
    holds (the k-th, the 2k-th..., as ``apply_activation_checkpointing`` picks them); none without it."""
    if strategy.checkpointing == "none":
        return frozenset()
    k = strategy.checkpoint_every
    return frozenset(block.name for block in stage.blocks[k - 1 :: k])


def checkpointed_blocks(strategy: Strategy, stage: Stage) -> frozenset[str]:
    """Of the covered blocks, those whose backward reruns their forward (``recomputes_block``)."""
    covered = covered_blocks(strategy, stage)
    return frozenset(
        block.name for block in stage.blocks if block.name in covered and recomputes_block(block, strategy)
    )


def block_activations(profile: WorkloadProfile, strategy: Strategy, stage: Stage) -> dict[str, float]:
    """Each block of the stage: bytes saved for backward per micro-batch without checkpointing (but Korthikanti's
    analytic selective recomputation, in the blocks it covers). Identical blocks (all of an analytic
    transformer's) are computed once."""
    covered = covered_blocks(strategy, stage)
    plain = replace(strategy, checkpointing="none", checkpoint_every=1)
    key = activation_key(strategy)
    decoder_from = len(profile.blocks) - (profile.transformer.decoder_layers if profile.transformer else 0)
    decoder_names = {b.name for b in profile.blocks[decoder_from:]}
    out: dict[str, float] = {}
    same: dict[tuple[bool, bool, float], float] = {}
    for block in stage.blocks:
        decoder, policy = block.name in decoder_names, strategy if block.name in covered else plain
        signature = (decoder, block.name in covered, block.activation_bytes_per_sample[key])
        if signature not in same:
            same[signature] = block_activation(profile, block, policy, decoder=decoder)
        out[block.name] = same[signature]
    return out


def stage_memory(
    profile: WorkloadProfile, strategy: Strategy, stage: Stage, *, gpus_per_node: int, cpu: bool = False
) -> MemoryBreakdown:
    """Memory of one GPU of ``stage`` at the peak of a step, by component (see the module docstring); ``cpu``: of
    the one process that runs it on a CPU instead."""
    head = stage.fixed[-1] if stage.index == strategy.pipeline - 1 and stage.fixed else None
    states = _model_states(profile, strategy, stage, gpus_per_node)
    cast = _cast_params(profile, strategy, stage, head)
    weight_copies, comm_buffers = _weight_copies_and_comm_buffers(strategy, stage, states, cast)

    # activations kept per layer (the first stage keeps several micro-batches in flight, the last one of its head)
    in_flight = in_flight_micro_batches(strategy, stage.index)
    flights = _micro_batches_held(strategy, stage, in_flight)
    full_blocks = block_activations(profile, strategy, stage)
    kept = _kept_activations(profile, strategy, stage, full_blocks)
    activations = sum(kept[name] * flights[name] for name in kept)
    activations += _fixed_activations(profile, strategy, stage, flights, in_flight)
    activations += held_stage_outputs(profile, strategy, stage, in_flight)
    activations += pipeline_step_tensors(profile, strategy, stage, in_flight)
    # autocast's copies of each layer's weights, in bytes: FSDP's and ZeRO-2's whole units make them unnecessary
    copy_share = COMPUTE_COPY_BYTES[strategy.precision] if states.zero_stage < 2 else 0
    autocast_copies = {name: params * copy_share for name, params in cast.items()}
    rise = {
        layer.name: _forward_rise(layer, strategy, full_blocks.get(layer.name, kept[layer.name]), autocast_copies)
        for layer in (*stage.blocks, *stage.fixed)
    }
    working = _backward_working_sets(profile, strategy, stage, head, full_blocks, rise, autocast_copies)
    temporary = max(working.values(), default=0.0)  # the working sets that grow with the micro-batch
    tables = _table_gradients(profile, strategy, stage, states, head)
    table_grads = max(tables.values(), default=0.0)

    # gradients exist through the forward under accumulation, DDP's buckets and pipelines; otherwise each layer's
    # arrive as its backward ends
    coexist = strategy.accumulation > 1 or (strategy.data > 1 and states.zero_stage < 2) or strategy.pipeline > 1
    grad_share = 0.0 if coexist else states.grads / max(1, stage.params)
    checkpointed = checkpointed_blocks(strategy, stage)
    layers = _layers_in_model_order(
        profile, strategy, kept, autocast_copies, rise, working | tables, grad_share, checkpointed, flights
    )
    grads_before = states.grads if coexist else 0.0
    # FSDP's and ZeRO-2's unsharded units are there through the step; autocast's copies come and go by layer
    units = 0.0 if copy_share else weight_copies
    forward_peak = _forward_peak(layers, held=(activations - sum(kept.values())) + grads_before + units)
    saved_copies = sum(layer.copies for layer in layers) if copy_share else weight_copies
    backward_peak = _backward_peak(
        layers,
        held=activations + saved_copies,
        grads=grads_before,
        head=head,
        tied_grad=_tied_head_gradient(profile, strategy, states, head),
    )
    workspaces = 0.0 if cpu else CUBLAS_WORKSPACE_BYTES
    allocated = states.weights + states.optimizer + comm_buffers + workspaces + max(forward_peak, backward_peak)
    return MemoryBreakdown(
        weights=states.weights,
        grads=states.grads,
        optimizer=states.optimizer,
        weight_copies=weight_copies,
        activations=activations,
        temporary=temporary,
        table_grads=table_grads,
        comm_buffers=comm_buffers,
        workspaces=workspaces,
        fragmentation=FRAGMENTATION * allocated,
        cuda_context=0.0 if cpu else CUDA_CONTEXT_BYTES,
        nccl=NCCL_BUFFER_BYTES if strategy.gpus > 1 and not cpu else 0.0,
        allocated=allocated,
        grads_with_activations=coexist,
    )


@dataclass(frozen=True)
class _ModelStates:
    """The model states of one stage on one GPU, in bytes, and what the other parts need of how they are kept."""

    params: float  # the stage's parameters on this GPU (its tensor-parallel share), before sharding
    zero_stage: int
    grad_bytes_per_param: float  # of a whole (unsharded) gradient
    weights: float
    grads: float
    optimizer: float


def _tensor_parallel_share(layer: LayerProfile, tensor: int) -> float:
    """A layer's parameters on one tensor-parallel rank, as the runtime's ``apply_tp`` shards them: those its plan
    splits (``tensor_split_params``, counted by the tracer from the runtime's plan) ``tensor`` ways, the rest
    whole on every rank. Without the plan, the matmul weights (those autocast casts, ``cast_params``) and the
    embedding tables split and the rest (norms) stay whole, which is Llama's layout; where the tracer did not
    tell those apart either (``cast_params`` None), all of them split."""
    if tensor == 1:
        return layer.params
    if layer.tensor_split_params is not None:
        split = layer.tensor_split_params
    elif layer.cast_params is not None:
        split = layer.cast_params + layer.table_params
    else:
        return layer.params / tensor
    return split / tensor + (layer.params - split)


def _whole_beside_fsdp(layer: LayerProfile, tensor: int) -> float:
    """Of a layer's parameters on one tensor-parallel rank, those the data ranks do not shard: beside tensor
    parallelism the runtime's FSDP2 keeps a packed projection's 1-D bias (GPT-2's c_attn) whole on each data
    rank (``replicated_beside_fsdp_params``, its tensor-parallel share)."""
    return layer.replicated_beside_fsdp_params / tensor if tensor > 1 else 0.0


def _model_states(profile: WorkloadProfile, strategy: Strategy, stage: Stage, gpus_per_node: int) -> _ModelStates:
    """PyTorch keeps fp32 weights and gradients (autocast adds no master copy). ZeRO-1 (ZeroRedundancyOptimizer)
    shards the optimizer states; ZeRO-2 as FSDP runs it (reshard_after_forward=False) also the gradients and the
    fp32 weights, keeping the 16-bit copies whole between forward and backward; FSDP/ZeRO-3 shards everything
    but what FSDP2 keeps whole beside tensor parallelism (``_whole_beside_fsdp``). Under a pipeline,
    ``torch.distributed.pipelining`` accumulates FSDP's gradients whole until the last micro-batch (it turns the
    per-micro-batch reduce-scatter off), so they are not sharded there."""
    layers = (*stage.blocks, *stage.fixed)
    params = sum(_tensor_parallel_share(layer, strategy.tensor) for layer in layers)
    whole = sum(_whole_beside_fsdp(layer, strategy.tensor) for layer in layers)
    if stage.index == strategy.pipeline - 1 and strategy.pipeline > 1:
        # the last stage keeps its own copy of a tied embedding table (vocabulary-split under TP)
        params += profile.tied_params / strategy.tensor
    states = pytorch_state_bytes(strategy.precision, optimizer_bytes(profile, strategy))
    zero_stage = ZERO_STAGE[strategy.sharding]
    shard = shard_degree(strategy, gpus_per_node)

    def sharded(bytes_per_param: float, from_stage: int) -> float:
        if zero_stage < from_stage:
            return params * bytes_per_param
        return ((params - whole) / shard + whole) * bytes_per_param

    return _ModelStates(
        params=params,
        zero_stage=zero_stage,
        grad_bytes_per_param=states.grads,
        weights=sharded(states.weights, 2),
        grads=params * states.grads if _pipeline_holds_fsdp_units(strategy) else sharded(states.grads, 2),
        optimizer=sharded(states.optimizer + states.master, 1),
    )


def _pipeline_holds_fsdp_units(strategy: Strategy) -> bool:
    """Whether a pipeline stage keeps FSDP's gathered weights and its whole gradients through the step:
    ``torch.distributed.pipelining`` turns resharding after backward and the gradients' reduce-scatter off for
    every micro-batch but the last (``backward_maybe_with_nosync``) and reduce-scatters once at the end."""
    return strategy.pipeline > 1 and ZERO_STAGE[strategy.sharding] >= 2


def _cast_params(
    profile: WorkloadProfile, strategy: Strategy, stage: Stage, head: LayerProfile | None
) -> dict[str, float]:
    """Parameters of each layer on this GPU that autocast copies into the compute precision: the weights of
    matmuls and convolutions, not an embedding's table (a lookup), unless an LM head on this stage uses it
    (shares it, or keeps a copy of it)."""
    t = strategy.tensor
    cast = {
        layer.name: (layer.params - layer.table_params if layer.cast_params is None else layer.cast_params) / t
        for layer in (*stage.blocks, *stage.fixed)
    }
    if head is not None:
        cast[head.name] += profile.tied_params / t
    return cast


def _weight_copies_and_comm_buffers(
    strategy: Strategy, stage: Stage, states: _ModelStates, cast: dict[str, float]
) -> tuple[float, float]:
    """Bytes of the weights' compute copies (autocast's, or FSDP's unsharded units) and of the buffers their
    gradients are communicated in, as the states are sharded."""
    copy_bytes = COMPUTE_COPY_BYTES[strategy.precision]
    largest_block = max((b.params for b in stage.blocks), default=0) / strategy.tensor
    fixed_params = sum(layer.params for layer in stage.fixed) / strategy.tensor
    if _pipeline_holds_fsdp_units(strategy):
        # the stage's units stay gathered through the step; its gradients are whole until the one reduce-scatter
        weight_copies = (copy_bytes or 4) * states.params
        comm_buffers = (4 + copy_bytes) * max(largest_block, fixed_params)
    elif states.zero_stage >= 3:
        # FSDP: the root unit (embedding, head) and two block units unsharded at once (prefetch), in the
        # compute precision (fp32 units when there is no mixed precision)
        unit_bytes = copy_bytes or 4
        weight_copies = unit_bytes * (fixed_params + 2 * largest_block)
        # the unsharded fp32 gradient of one unit before its reduce-scatter, plus its compute-precision form
        comm_buffers = (4 + copy_bytes) * max(largest_block, fixed_params)
    elif states.zero_stage == 2:
        # the unsharded units stay from forward to backward (fp32 units without mixed precision)
        weight_copies = (copy_bytes or 4) * states.params
        comm_buffers = (4 + copy_bytes) * max(largest_block, fixed_params)
    else:
        weight_copies = copy_bytes * sum(cast.values())  # autocast keeps every cast weight saved for backward
        # DDP with gradient_as_bucket_view=True (the runtime sets it): gradients live in the buckets
        comm_buffers = 2 * DDP_BUCKET_BYTES if strategy.data > 1 else 0.0
    return weight_copies, comm_buffers


def _kept_activations(
    profile: WorkloadProfile, strategy: Strategy, stage: Stage, full_blocks: dict[str, float]
) -> dict[str, float]:
    """Bytes each layer of the stage keeps for its backward, for one micro-batch: a checkpointed block its input,
    and under measured selective checkpointing what the policy saved (matmul outputs, split t ways as the
    matmuls are); an analytic one under selective checkpointing all but its attention core (Korthikanti).

    The layers outside the blocks keep whole activations on every tensor-parallel rank: the runtime's
    vocabulary-split head gathers the logits whole so that the user's loss runs unchanged (the loss's
    log-softmax, the logits and the head's gathered input are b x s x V and b x s x h on each rank), and the
    embedding's output is the replicated residual stream. Only under sequence parallelism is the embedding's
    output split along the sequence; the head's norm also computes on a rank's rows then, which this still
    counts whole (a little over: measured on the CPU, a tiny Llama's head and embedding split t ways put the
    plan 8-11% under what a TP=2 rank saved). A vocabulary-split embedding also saves the token ids it looked up,
    shifted into its rank's rows (the repo's GPT at TP=2: the plan was 1,024 bytes under without them)."""
    key = activation_key(strategy)
    t = strategy.tensor
    sp_divisor = t if strategy.sequence_parallel else 1
    checkpointed = checkpointed_blocks(strategy, stage)
    kept: dict[str, float] = {}
    for layer in (*stage.blocks, *stage.fixed):
        if not layer.is_block:
            per_sample = layer.activation_bytes_per_sample[key] / (sp_divisor if layer.table_params else 1)
            if layer.table_params and t > 1:
                # a vocabulary-split lookup saves its own copy of the token ids, shifted into the rank's rows
                per_sample += layer.input_bytes_per_sample.get(key, 0.0)
            kept[layer.name] = per_sample * strategy.micro_batch
        elif layer.name in checkpointed:
            per_sample = block_input_bytes(profile, layer, strategy) / sp_divisor
            if strategy.checkpointing == "selective":
                per_sample += layer.selective_bytes_per_sample[key] / t
            kept[layer.name] = per_sample * strategy.micro_batch
        else:
            kept[layer.name] = full_blocks[layer.name]
    return kept


def _fixed_activations(
    profile: WorkloadProfile, strategy: Strategy, stage: Stage, flights: dict[str, float], in_flight: float
) -> float:
    """Bytes a stage keeps for its backward, per micro-batch whatever its size (the tracer's constant terms), for
    its micro-batches in flight (``flights`` of each layer outside the blocks, ``in_flight`` of its blocks):
    the per-sequence tensors its layers save (position ids, the loss's total weight; a block's rotary tables), or
    under checkpointing those a block is given and its checkpoint keeps (all its blocks share them: once), and
    without a pipeline the step's scalars around the loss. Not split by tensor parallelism: each rank makes its own.
    The tracer charges a tensor all blocks share to the first block that saves it; a pipeline stage without that
    block makes its own (the runtime's stage code computes the positions and rotary tables for its blocks)."""
    key = activation_key(strategy)
    outside = sum(layer.activation_fixed_bytes.get(key, 0.0) * flights[layer.name] for layer in stage.fixed)
    checkpointed = checkpointed_blocks(strategy, stage)
    full = [block for block in stage.blocks if block.name not in checkpointed]
    fixed = sum(block.activation_fixed_bytes.get(key, 0.0) for block in full)
    first = profile.blocks[0] if profile.blocks else None
    # the model's first block, on another stage, reruns its forward only where every block does
    first_reruns = first is not None and strategy.checkpoint_every == 1 and recomputes_block(first, strategy)
    # blocks compared by name: a LayerProfile's own equality compares every figure it holds
    on_stage = {block.name for block in stage.blocks}
    if full and first is not None and first.name not in on_stage and not first_reruns:
        fixed += first.activation_fixed_bytes.get(key, 0.0)
    fixed += max((b.input_fixed_bytes.get(key, 0.0) for b in stage.blocks if b.name in checkpointed), default=0.0)
    # a pipeline's schedule keeps its own scalars around the loss (``pipeline_step_tensors``)
    fixed += STEP_SCALAR_BYTES if strategy.pipeline == 1 else 0.0
    return outside + fixed * in_flight


def _micro_batches_held(strategy: Strategy, stage: Stage, in_flight: float) -> dict[str, float]:
    """How many micro-batches' activations of each layer of the stage are held at once: the stage's in flight
    for its blocks, ``outside_blocks_micro_batches`` for the others (an LM's head: one but under GPipe)."""
    outside = outside_blocks_micro_batches(strategy, stage, in_flight)
    return {block.name: in_flight for block in stage.blocks} | {layer.name: outside for layer in stage.fixed}


def _forward_rise(layer: LayerProfile, strategy: Strategy, saved: float, autocast_copies: dict[str, float]) -> float:
    """How far memory rises while the layer's forward runs: measured, or what it saves and its weight copies.
    (The measurement ran under autocast: under FSDP, whose 16-bit units make autocast's copies unnecessary, it
    counts a layer's weights once more, on the safe side.)"""
    rise = measured_bytes(layer.forward_rise, layer, strategy, saved)
    return saved + autocast_copies[layer.name] if rise is None else rise


def _backward_working_sets(
    profile: WorkloadProfile,
    strategy: Strategy,
    stage: Stage,
    head: LayerProfile | None,
    full_blocks: dict[str, float],
    rise: dict[str, float],
    autocast_copies: dict[str, float],
) -> dict[str, float]:
    """The working set of each block's backward, on top of what is still saved: its activation gradients (where it
    is recomputed also its recomputed activations and the weight copies its recomputation casts again: under
    selective checkpointing this counts the saved matmul outputs twice, on the safe side);
    and the loss's for an LM's head. Copies per parameter: autocast's, not FSDP's whole units."""
    working = {}
    checkpointed = checkpointed_blocks(strategy, stage)
    for block in stage.blocks:
        saved = full_blocks[block.name]
        backward = measured_bytes(block.backward_working, block, strategy, saved)
        if backward is None:  # not measured: all it saved, at most
            backward = saved
        if block.name in checkpointed:
            # the recomputation's forward (its rise counts the block's input, which is already held, where the
            # gradient of its output now waits), then the backward on what it saved and the weight copies it cast
            backward = max(rise[block.name], saved + backward + autocast_copies[block.name])
        working[block.name] = backward
    if profile.loss_vocab and head is not None:
        # cross-entropy runs in fp32, under autocast too: while log-softmax's backward runs, the fp32 gradients
        # of its output (the NLL's, dense) and of its input, b x s x V each
        tokens = strategy.micro_batch * profile.tokens_per_sample
        working[head.name] = LOSS_BACKWARD_BYTES * tokens * profile.loss_vocab / strategy.tensor
    return working


def _tied_head_gradient(
    profile: WorkloadProfile, strategy: Strategy, states: _ModelStates, head: LayerProfile | None
) -> float:
    """Bytes of the gradient an LM head gives the embedding table it is tied to on the same GPU: autograd holds it
    from the head's backward until the embedding's adds its own."""
    if head is None or strategy.pipeline > 1 or states.zero_stage >= 2:
        return 0.0
    return states.grad_bytes_per_param * (profile.tied_params / strategy.tensor)


def _table_gradients(
    profile: WorkloadProfile, strategy: Strategy, stage: Stage, states: _ModelStates, head: LayerProfile | None
) -> dict[str, float]:
    """The working set of an embedding's backward: a dense gradient of its whole table, which becomes its
    gradient or is added to the one there. A table tied to the LM head on the same GPU got the head's gradient
    first, and the two are summed into a third tensor. Sharded gradients are not counted here."""
    if states.zero_stage >= 2:
        return {}
    tied = _tied_head_gradient(profile, strategy, states, head)
    return {
        layer.name: states.grad_bytes_per_param * layer.table_params / strategy.tensor + tied
        for layer in stage.fixed
        if layer.table_params
    }


@dataclass(frozen=True)
class _LayerMemory:
    """What one layer of the stage puts on one GPU during a step, in bytes."""

    layer: LayerProfile
    kept: float  # saved for its backward, one micro-batch
    output: float  # of that, what the loop holds to the end of the step (the model's output)
    copies: float  # autocast's copies of its weights, saved for its backward
    rise: float  # how far memory rises while its forward runs, above what the layers before it keep
    working: float  # its backward's working set, on top of what is still held
    grads: float  # the gradients that arrive as its backward ends (none where all exist from the start)
    in_flight: float  # micro-batches whose activations of it are held at once (``_micro_batches_held``)


def _layers_in_model_order(
    profile: WorkloadProfile,
    strategy: Strategy,
    kept: dict[str, float],
    autocast_copies: dict[str, float],
    rise: dict[str, float],
    working: dict[str, float],
    grad_share: float,
    checkpointed: frozenset[str],
    flights: dict[str, float],
) -> list[_LayerMemory]:
    """The stage's layers as the forward meets them (``checkpointed``: the blocks that rerun their forward;
    ``flights``: the micro-batches in flight of each)."""
    key = activation_key(strategy)
    return [
        _LayerMemory(
            layer=layer,
            kept=kept[layer.name],
            output=min(
                layer.held_bytes_per_sample.get(key, 0.0) * strategy.micro_batch / strategy.tensor, kept[layer.name]
            ),
            # a checkpointed block saves no weight copies (autocast without its weight cache, as the runtime runs
            # it: a loop with the cache on holds them to the end of the forward)
            copies=0.0 if layer.name in checkpointed else autocast_copies[layer.name],
            rise=rise[layer.name],
            working=working.get(layer.name, 0.0),
            grads=layer.params * grad_share,
            in_flight=flights[layer.name],
        )
        for layer in profile.layers
        if layer.name in kept
    ]


def _forward_peak(layers: list[_LayerMemory], held: float) -> float:
    """The most memory in use through the forward, on top of ``held`` (the micro-batches in flight before, the
    gradients that exist from the start, sharded units): each layer's rise on top of what the layers before it
    keep, and at its end all they keep."""
    peak = 0.0
    for layer in layers:
        peak = max(peak, held + layer.rise)
        held += layer.kept + layer.copies
    return max(peak, held)


def _backward_peak(
    layers: list[_LayerMemory],
    *,
    held: float,
    grads: float,
    head: LayerProfile | None,
    tied_grad: float,
) -> float:
    """The most memory in use through the backward, which walks the layers from the last, starting from ``held``
    (every activation and weight copy saved) and ``grads`` (the gradients that exist already). As a layer's
    backward starts, the gradients of every layer after it exist, its own and earlier activations are still
    held, and its working set comes on top; as it ends, its gradients replace its activations (but for the
    model's output, which the loop holds to the end) and autocast's copies of its weights. A CNN peaks mid-way:
    its big activations are early, its big parameters late; a checkpointed LM at its embedding, where the head's
    gradient of a tied table (``tied_grad``) still waits."""
    pending = 0.0  # the head's gradient of a tied embedding table, waiting for the embedding's
    peak = 0.0
    for memory in reversed(layers):
        peak = max(peak, grads + pending + held + memory.working)
        grads += memory.grads
        held -= (memory.kept - memory.output) * memory.in_flight + memory.copies
        if memory.layer is head:
            pending = tied_grad
        elif memory.layer.table_params:
            pending = 0.0
        peak = max(peak, grads + pending + held)
    return peak


def shard_degree(strategy: Strategy, gpus_per_node: int) -> int:
    """Ranks that share the sharded states: the data-parallel group, or under HSDP its part inside one
    node (replicated across nodes)."""
    if strategy.sharding == "hsdp":
        return max(1, min(strategy.data, gpus_per_node // strategy.tensor))
    return strategy.data


def memory_per_gpu(
    profile: WorkloadProfile, strategy: Strategy, gpus_per_node: int, *, cpu: bool = False
) -> MemoryBreakdown:
    """The busiest pipeline stage's memory. Micro-batches in flight fall with a stage's index and blocks per stage
    rise by one where the remainder starts (``block_counts``), so the busiest is the first stage, the first stage
    that holds one block more, or the last (the head: a large untied one, and the logits). ``cpu``: the strategy
    runs on a CPU (``Cluster.on_cpu``), without a GPU's runtime (CUDA context, NCCL, cuBLAS)."""
    split = stages(profile, strategy.pipeline)
    counts = [len(stage.blocks) for stage in split]
    more = next((index for index, count in enumerate(counts) if count > counts[0]), 0)
    busiest = [split[index] for index in sorted({0, more, len(split) - 1})]
    candidates = [stage_memory(profile, strategy, stage, gpus_per_node=gpus_per_node, cpu=cpu) for stage in busiest]
    return _calibrated(profile, max(candidates, key=lambda m: m.device_total))


class Footprints:
    """``memory_per_gpu`` of one workload, each (strategy, GPUs per node, CPU or not) worked out once: a cloud
    ranking estimates the same strategies on every instance with as many GPUs, and memory does not depend on
    which GPU they are (whether it fits does)."""

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile
        self._known: dict[tuple[Strategy, int, bool], MemoryBreakdown] = {}

    def of(self, strategy: Strategy, gpus_per_node: int, *, cpu: bool = False) -> MemoryBreakdown:
        key = (strategy, gpus_per_node, cpu)
        if key not in self._known:
            self._known[key] = memory_per_gpu(self.profile, strategy, gpus_per_node, cpu=cpu)
        return self._known[key]


def _calibrated(profile: WorkloadProfile, memory: MemoryBreakdown) -> MemoryBreakdown:
    """Correct the parts that grow with the micro-batch (activations, the backward working set) by the measured
    over predicted growth per sample that ``redline plan --calibrate`` found on this device, and the peak also
    by the fixed difference (model states, workspaces)."""
    fitted = profile.calibration.memory if profile.calibration is not None else None
    if fitted is None:
        return memory
    scale, offset = fitted
    growing = memory.activations + memory.temporary
    allocated = max(memory.allocated + (scale - 1) * growing + offset, 0.0)
    return replace(
        memory,
        activations=memory.activations * scale,
        temporary=memory.temporary * scale,
        allocated=allocated,
        fragmentation=FRAGMENTATION * allocated,
    )
