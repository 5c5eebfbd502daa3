"""Time of one optimizer step of one strategy: compute, communication, pipeline bubble, optimizer.

Compute is a roofline per micro-batch (``runtime_estimator.py`` in torch.distributed._tools does the same
per operator): matmul FLOPs over the achievable matmul rate, plus the memory-bound work (norms,
activations, elementwise ops), modelled as the activation bytes read and written ``ACTIVATION_TRAFFIC``
times over the memory bandwidth. Communication uses the alpha-beta model of ``plan.comm`` with each
strategy's volumes (ZeRO paper section 7, Megatron-LM, Narayanan et al. 2021); what can hide behind
compute is subtracted, what cannot stays on the critical path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from redline.plan.comm import Collective, collective_s, network_share, p2p_s, ring_s
from redline.plan.hardware import Cluster
from redline.plan.memory import (
    DDP_BUCKET_BYTES,
    Stage,
    activation_key,
    activation_value_bytes,
    block_activations,
    block_input_bytes,
    covered_blocks,
    optimizer_bytes,
    shard_degree,
    stages,
)
from redline.plan.model_states import ZERO_STAGE
from redline.plan.strategy import Strategy
from redline.workload.profile import LayerProfile, WorkloadProfile
from redline.workload.transformer import attention_core_flops

# A training step's GEMMs (split by tensor parallelism, of many shapes) sustain less than one large GEMM.
# 0.79 of the matmul ceiling is fitted on Narayanan et al.'s three 175B runs (Table 2, 384-1536 A100) and
# checked on the held-out cases of benchmarks/plan_vs_published.py (at 1.0 the planner over-predicted
# the published runs by a median 23%).
SUSTAINED_MATMUL_FRACTION = 0.79
# Each activation byte is written in the forward pass, read in the backward pass, and its gradient is
# written and read once: four passes over memory for the memory-bound (non-matmul) operators.
ACTIVATION_TRAFFIC = 4.0
# The optimizer step reads and writes every parameter, gradient and state it owns once (fused AdamW).
OPTIMIZER_TRAFFIC = 2.0
# Eager PyTorch launches each operator separately; a small micro-batch cannot hide the launch cost. A
# transformer block runs about 20 kernels forward and twice that backward, each costing a few microseconds
# of CPU-side launch time whatever its size.
KERNELS_PER_BLOCK = 20
LAUNCH_OVERHEAD_S = 5e-6
GRAD_REDUCE_BYTES = 4  # gradients are reduced in fp32 (DDP on fp32 grads; FSDP2 reduce_dtype=float32)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part; ``total`` is what a step takes."""

    compute: float  # forward + backward (+ recomputation) of every micro-batch
    bubble: float  # pipeline fill and drain
    data_parallel_comm: float  # gradient reduction and parameter gathering left exposed
    tensor_parallel_comm: float  # per-layer all-reduces (never overlapped)
    pipeline_comm: float  # activations between stages
    optimizer: float

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.bubble
            + self.data_parallel_comm
            + self.tensor_parallel_comm
            + self.pipeline_comm
            + self.optimizer
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total": self.total}


@dataclass(frozen=True)
class Groups:
    """Where the members of each parallel group sit (ranks: tensor innermost, then data, then pipeline)."""

    dp_per_node: int
    dp_nodes: int
    pp_crosses_nodes: bool


def groups(strategy: Strategy, cluster: Cluster) -> Groups:
    per_node = max(1, cluster.gpus_per_node // strategy.tensor)
    # some stage boundary crosses nodes once the whole pipeline does not fit in one node
    pp_crosses = strategy.pipeline > 1 and strategy.gpus > cluster.gpus_per_node
    if strategy.data <= per_node:
        return Groups(strategy.data, 1, pp_crosses)
    return Groups(per_node, strategy.data // per_node, pp_crosses)


def _micro_batch_compute_s(
    profile: WorkloadProfile, strategy: Strategy, stage: Stage, cluster: Cluster
) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on one stage; recomputation counts in backward: full
    checkpointing reruns each block's forward; selective reruns what ``workload.selective`` does not keep: the
    memory-bound half of the forward, and without flash attention the attention core's FLOPs (Korthikanti et al.
    2022, section 5; a fused attention kernel's output is kept, so nothing of the attention is rerun)."""
    b, t = strategy.micro_batch, strategy.tensor
    rate = cluster.matmul[strategy.precision].value * SUSTAINED_MATMUL_FRACTION
    bandwidth = cluster.memory_bandwidth.value
    # what the forward writes and the backward reads, kept or recomputed
    blocks = block_activations(profile, replace(strategy, checkpointing="none", checkpoint_every=1), stage)
    core_flops = recomputed_core_flops_per_sample(profile, strategy)
    rerun = covered_blocks(strategy, stage)
    forward = backward = 0.0
    for layer in (*stage.blocks, *stage.fixed):
        flops = layer.forward_flops_per_sample * b / t
        if layer.is_block:
            acts = blocks[layer.name]
        else:
            acts = layer.activation_bytes_per_sample[activation_key(strategy)] * b / t
        memory_s = ACTIVATION_TRAFFIC * acts / bandwidth
        launches = KERNELS_PER_BLOCK * LAUNCH_OVERHEAD_S if layer.is_block else 0.0
        # a kernel runs while the next is launched: the launch cost shows only where it exceeds the work
        layer_forward = max(flops / rate + memory_s / 2, launches)
        forward += layer_forward
        backward += max(2 * flops / rate + memory_s / 2, 2 * launches)
        if layer.name in rerun and strategy.checkpointing == "full":
            backward += layer_forward
        elif layer.name in rerun:  # selective
            backward += core_flops * b / t / rate + memory_s / 2
    if profile.calibration is not None and forward + backward > 0:  # measured here: correct the total, keep the split
        # the floor was measured on the whole model: this stage launches its layers' share, and a recomputed
        # forward adds about a third
        share = len(stage.blocks) + len(stage.fixed)
        rerun_share = len(rerun) / share if strategy.checkpointing == "full" else 0.0
        floor_share = share / max(1, len(profile.layers)) * (1 + rerun_share / 3)
        factor = profile.calibration.corrected_compute_s(forward + backward, floor_share) / (forward + backward)
        forward, backward = forward * factor, backward * factor
    return forward, backward


def attention_core_flops_per_sample(profile: WorkloadProfile) -> float:
    """Forward FLOPs of one block's attention core for one sample, which selective checkpointing recomputes (a
    transformer's; 0 where the profile has no transformer shape to tell them)."""
    shape = profile.transformer
    return 0.0 if shape is None else attention_core_flops(shape, profile.tokens_per_sample)


def recomputed_core_flops_per_sample(profile: WorkloadProfile, strategy: Strategy) -> float:
    """Forward FLOPs of one block's attention core that selective checkpointing reruns per sample: all of them
    for an unfused core, none for a fused kernel (flash attention), whose output is kept."""
    return 0.0 if strategy.flash_attention else attention_core_flops_per_sample(profile)


def recomputed_flops_per_sample(profile: WorkloadProfile, strategy: Strategy) -> float:
    """Forward FLOPs a step recomputes per sample: every checkpointed block's under full checkpointing, its
    unfused attention core under selective (hardware FLOPs, HFU)."""
    rerun: list[LayerProfile] = []
    for stage in stages(profile, strategy.pipeline):
        names = covered_blocks(strategy, stage)
        rerun += [block for block in stage.blocks if block.name in names]
    if strategy.checkpointing == "full":
        return sum(b.forward_flops_per_sample for b in rerun)
    return len(rerun) * recomputed_core_flops_per_sample(profile, strategy)


def step_time(profile: WorkloadProfile, strategy: Strategy, cluster: Cluster) -> StepTime:
    """One optimizer step of ``strategy`` on ``cluster``.

    The slowest pipeline stage sets the pace. With GPipe or 1F1B over p stages and m micro-batches a step
    takes m + p - 1 micro-batch slots, the p - 1 extra being the bubble, (p - 1)/m of the ideal time; the
    interleaved schedule's v virtual stages per rank shrink it to (p - 1)/(v m) (Narayanan et al. 2021,
    section 2.2). A slot is a micro-batch's compute plus its tensor-parallel all-reduces, which nothing hides.
    """
    m, p, t = strategy.accumulation, strategy.pipeline, strategy.tensor
    stage = max(stages(profile, p), key=lambda s: sum(layer.forward_flops_per_sample for layer in s.blocks + s.fixed))
    forward, backward = _micro_batch_compute_s(profile, strategy, stage, cluster)
    micro_batch_s = forward + backward
    where = groups(strategy, cluster)
    shape = profile.transformer
    value = activation_value_bytes(strategy)

    # tensor parallel (Megatron-LM): 4 all-reduces of b*s*h per block per micro-batch (2 forward, 2 backward),
    # 6 with full recomputation; sequence parallelism swaps each for a reduce-scatter + all-gather of the
    # same volume (Korthikanti et al. 2022, section 4.2)
    tp_micro_s = 0.0
    if t > 1 and shape is not None:
        size = strategy.micro_batch * profile.tokens_per_sample * shape.hidden * value
        # a block whose forward is rerun in full all-reduces its forward's twice again
        all_reduces = 4 * len(stage.blocks) + (
            2 * len(covered_blocks(strategy, stage)) if strategy.checkpointing == "full" else 0
        )
        tp_micro_s = all_reduces * ring_s("all_reduce", size, t, cluster.intra)

    # pipeline: each micro-batch crosses each boundary forward (activations) and backward (their gradients): a
    # block's input (a transformer's b*s*h residual stream, as wide as the runtime keeps it: plan.dtypes), split t
    # ways (Megatron's scatter/gather optimisation); interleaved, each rank sends every micro-batch on v times
    pp_s = 0.0
    if p > 1:
        sent_bytes = block_input_bytes(profile, stage.blocks[0], strategy) * strategy.micro_batch / t
        inter = cluster.inter if where.pp_crosses_nodes and cluster.nodes > 1 else None
        link = network_share(inter, cluster.gpus_per_node) if inter is not None else cluster.intra
        pp_s = 2 * (strategy.virtual_stages * m + p - 1) * p2p_s(sent_bytes, link)

    return StepTime(
        compute=m * micro_batch_s,
        bubble=bubble_slots(strategy) * (micro_batch_s + tp_micro_s),
        data_parallel_comm=_data_parallel_exposed_s(profile, strategy, cluster, stage, where, forward, backward),
        tensor_parallel_comm=m * tp_micro_s,
        pipeline_comm=pp_s,
        optimizer=_optimizer_s(profile, strategy, cluster, stage),
    )


def bubble_slots(strategy: Strategy) -> float:
    """Micro-batch slots a step spends filling and draining the pipeline: p - 1 for GPipe and 1F1B, (p - 1)/v
    for interleaved 1F1B (Narayanan et al. 2021, section 2.2: a bubble of (p - 1)/m and (p - 1)/(v m) of the
    ideal m slots)."""
    return (strategy.pipeline - 1) / strategy.virtual_stages


def _data_parallel_exposed_s(
    profile: WorkloadProfile,
    strategy: Strategy,
    cluster: Cluster,
    stage: Stage,
    where: Groups,
    forward: float,
    backward: float,
) -> float:
    """Gradient reduction and parameter gathering of the data-parallel group, minus what overlaps.

    Volumes (ZeRO paper section 7, as PyTorch implements each): DDP all-reduces the gradients once per step
    (``no_sync`` during accumulation) behind the last backward pass, bucket by bucket, so only the last
    bucket is sure to be exposed. ZeRO-1 (DDP + ZeroRedundancyOptimizer) adds an all-gather of the updated
    fp32 parameters after the step, which nothing hides. ZeRO-2 (FSDP ``reshard_after_forward=False``)
    gathers the parameters before each micro-batch's forward (prefetched one unit ahead) and reduce-scatters
    its gradients behind its backward. FSDP (ZeRO-3) gathers each unit before its forward and again before
    its backward and reduce-scatters its gradients, every micro-batch. HSDP does FSDP inside a node and
    all-reduces the sharded gradients across nodes once per step. Under a pipeline, ``torch.distributed.
    pipelining`` keeps FSDP's units gathered and its gradients whole through the step: one gather, hidden by
    the first forward, and one reduce-scatter after the last backward, which nothing hides.
    """
    n = strategy.data
    if n <= 1:
        return 0.0
    m = strategy.accumulation
    params = stage.params / strategy.tensor
    grads = params * GRAD_REDUCE_BYTES
    gathered = params * activation_value_bytes(strategy)  # parameters are gathered in the compute precision
    units = max(1, len(stage.blocks))

    def dp(kind: Collective, size: float, *, per_node: int = where.dp_per_node, nodes: int = where.dp_nodes) -> float:
        return collective_s(
            kind,
            size,
            ranks_per_node=per_node,
            nodes=nodes,
            intra=cluster.intra,
            inter=cluster.inter,
            gpus_per_node=cluster.gpus_per_node,
        )

    if strategy.sharding in ("ddp", "zero1"):
        last_bucket = dp("all_reduce", min(DDP_BUCKET_BYTES, grads))
        exposed = max(dp("all_reduce", grads) - backward, last_bucket)
        if strategy.sharding == "zero1":
            exposed += dp("all_gather", params * 4)
        return exposed
    if strategy.sharding == "hsdp":
        shard = shard_degree(strategy, cluster.gpus_per_node)
        within = {"per_node": shard, "nodes": 1}
        gather, scatter = dp("all_gather", gathered, **within), dp("reduce_scatter", grads, **within)
        across = collective_s(
            "all_reduce",
            grads / shard,
            ranks_per_node=1,
            nodes=n // shard,
            intra=cluster.intra,
            inter=cluster.inter,
            gpus_per_node=cluster.gpus_per_node,
        )
    else:  # zero2, fsdp
        gather, scatter = dp("all_gather", gathered), dp("reduce_scatter", grads)
        across = 0.0
    if strategy.pipeline > 1:  # gathered once, reduce-scattered once after the last backward
        return max(gather - forward, 0.0) + gather / units + scatter + across
    if strategy.sharding == "zero2":
        return m * (max(gather - forward, 0.0) + gather / units + max(scatter - backward, scatter / units))
    # forward hides the gathers, backward the second gathers and the reduce-scatters; the first unit's
    # gather has nothing to hide behind
    per_micro = max(gather - forward, 0.0) + max(gather + scatter - backward, 0.0) + gather / units
    return m * per_micro + across


def _optimizer_s(profile: WorkloadProfile, strategy: Strategy, cluster: Cluster, stage: Stage) -> float:
    """A fused optimizer step is memory-bound: it streams the weights, gradients and states it owns
    (its shard under ZeRO-1 and above)."""
    opt_bytes = optimizer_bytes(profile, strategy)
    shard = shard_degree(strategy, cluster.gpus_per_node) if ZERO_STAGE[strategy.sharding] >= 1 else 1
    owned = stage.params / strategy.tensor / shard
    seconds = OPTIMIZER_TRAFFIC * owned * (4 + 4 + opt_bytes) / cluster.memory_bandwidth.value
    return seconds * (profile.calibration.optimizer_scale if profile.calibration is not None else 1.0)
