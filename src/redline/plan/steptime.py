"""Time of one optimizer step of one strategy: compute, communication, pipeline bubble, optimizer.

Compute is a roofline per micro-batch (``runtime_estimator.py`` in torch.distributed._tools does the same
per operator): each matmul timed by its shape at the micro-batch and tensor-parallel split planned
(``plan.gemm``: wave quantisation, memory traffic, a sustained rate; on a CPU, its measured rate by size),
plus the memory-bound work (norms, activations, elementwise ops), modelled as the activation bytes read and
written ``ACTIVATION_TRAFFIC`` times over the memory bandwidth. Communication uses the alpha-beta model of
``plan.comm`` with each strategy's volumes (ZeRO paper section 7, Megatron-LM, Narayanan et al. 2021); what
can hide behind compute is subtracted, what cannot stays on the critical path (FSDP's unit by unit, as FSDP2
overlaps it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from redline.plan.comm import Collective, collective_parts_s, network_share, p2p_s, ring_s
from redline.plan.gemm import Gemm, GemmDevice
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
from redline.workload.profile import LayerGemm, LayerProfile, WorkloadProfile
from redline.workload.transformer import attention_core_flops

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
    device = cluster.gemm_device(strategy.precision)
    bandwidth = cluster.memory_bandwidth.value
    # what the forward writes and the backward reads, kept or recomputed
    blocks = block_activations(profile, replace(strategy, checkpointing="none", checkpoint_every=1), stage)
    core_flops = recomputed_core_flops_per_sample(profile, strategy)
    rerun = covered_blocks(strategy, stage)
    forward = backward = 0.0
    # a model's blocks share their list of products (one tuple): time each list once per micro-batch
    matmul_s: dict[tuple[int, float], tuple[float, float, float]] = {}
    for layer in (*stage.blocks, *stage.fixed):
        key = (id(layer.gemms), layer.forward_flops_per_sample)
        if key not in matmul_s:
            matmul_s[key] = layer_matmul_s(device, layer, b, t, fused_attention=strategy.flash_attention)
        matmul_forward_s, matmul_backward_s, core_s = matmul_s[key]
        if not core_flops:  # a fused attention kernel's output is kept: selective reruns none of it
            core_s = 0.0
        elif not core_s:  # the core's products are not listed: at the large-GEMM rate
            core_s = core_flops * b / t / device.sustained_flops
        if layer.is_block:
            acts = blocks[layer.name]
        else:
            acts = layer.activation_bytes_per_sample[activation_key(strategy)] * b / t
        memory_s = ACTIVATION_TRAFFIC * acts / bandwidth
        launches = KERNELS_PER_BLOCK * LAUNCH_OVERHEAD_S if layer.is_block else 0.0
        # a kernel runs while the next is launched: the launch cost shows only where it exceeds the work
        layer_forward = max(matmul_forward_s + memory_s / 2, launches)
        forward += layer_forward
        backward += max(matmul_backward_s + memory_s / 2, 2 * launches)
        if layer.name in rerun and strategy.checkpointing == "full":
            backward += layer_forward
        elif layer.name in rerun:  # selective
            backward += core_s + memory_s / 2
    if profile.calibration is not None and forward + backward > 0:  # measured here: correct the total, keep the split
        # the floor was measured on the whole model: this stage launches its layers' share, and a recomputed
        # forward adds about a third
        share = len(stage.blocks) + len(stage.fixed)
        rerun_share = len(rerun) / share if strategy.checkpointing == "full" else 0.0
        floor_share = share / max(1, len(profile.layers)) * (1 + rerun_share / 3)
        factor = profile.calibration.corrected_compute_s(forward + backward, floor_share) / (forward + backward)
        forward, backward = forward * factor, backward * factor
    return forward, backward


def layer_matmul_s(
    device: GemmDevice, layer: LayerProfile, micro_batch: int, tensor: int, *, fused_attention: bool = True
) -> tuple[float, float, float]:
    """(forward, backward, attention core forward) seconds of a layer's matmuls for one micro-batch on one of
    ``tensor`` ranks. Each listed product is timed by its shape; its backward is the two products of the same FLOPs
    (the input's gradient, M x K over N, and the weights', K x N over M). Under ``fused_attention`` (flash
    attention) the attention core's products keep their scores on chip. FLOPs the layer does beyond its listed
    products (all of them where none are listed) run at the device's large-GEMM rate, their backward twice that."""
    forward_s, backward_s, core_s = _gemm_times(device, layer.gemms, micro_batch, tensor, fused_attention)
    listed = sum(g.flops_per_sample for g in layer.gemms) / tensor
    rest_s = max(0.0, layer.forward_flops_per_sample / tensor - listed) * micro_batch / device.sustained_flops
    return forward_s + rest_s, backward_s + 2 * rest_s, core_s


@functools.lru_cache(maxsize=4096)
def _gemm_times(
    device: GemmDevice, gemms: tuple[LayerGemm, ...], micro_batch: int, tensor: int, fused_attention: bool
) -> tuple[float, float, float]:
    """Cached: every block of a model lists the same products, and a search asks for the same few splits."""
    forward_s = backward_s = core_s = 0.0
    for gemm in gemms:
        shape = gemm_at(gemm, micro_batch, tensor, fused=fused_attention and gemm.attention_core)
        m, n, k, batch, fused = shape.m, shape.n, shape.k, shape.batch, shape.fused
        seconds = device.seconds(shape)
        forward_s += seconds
        backward_s += device.seconds(Gemm(m, k, n, batch, fused)) + device.seconds(Gemm(k, n, m, batch, fused))
        core_s += seconds if gemm.attention_core else 0.0
    return forward_s, backward_s, core_s


def gemm_at(gemm: LayerGemm, micro_batch: int, tensor: int, *, fused: bool = False) -> Gemm:
    """The product one of ``tensor`` ranks runs for a micro-batch: the micro-batch multiplies the rows of a linear
    layer or the count of a batched matmul; tensor parallelism divides the dimension the layer's split names."""
    rows = gemm.rows * (1 if gemm.batched else micro_batch)
    count = gemm.count * (micro_batch if gemm.batched else 1)
    cols, inner = gemm.cols, gemm.inner
    if gemm.tensor_split == "cols":
        cols = math.ceil(cols / tensor)
    elif gemm.tensor_split == "inner":
        inner = math.ceil(inner / tensor)
    else:
        count = math.ceil(count / tensor)
    return Gemm(rows, cols, inner, count, fused)


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
    fp32 parameters after the step, which nothing hides. ZeRO-2, FSDP and HSDP run FSDP2 per block, modelled
    unit by unit in ``_sharded_exposed_s``. Under a pipeline, ``torch.distributed.pipelining`` keeps FSDP's
    units gathered and its gradients whole through the step: one gather, hidden by the first forward, and one
    reduce-scatter after the last backward, which nothing hides.
    """
    n = strategy.data
    if n <= 1:
        return 0.0
    params = stage.params / strategy.tensor
    grads = params * GRAD_REDUCE_BYTES
    if strategy.sharding in ("ddp", "zero1"):
        last_bucket = _dp_collective(cluster, where, "all_reduce", min(DDP_BUCKET_BYTES, grads)).seconds
        exposed = max(_dp_collective(cluster, where, "all_reduce", grads).seconds - backward, last_bucket)
        if strategy.sharding == "zero1":
            exposed += _dp_collective(cluster, where, "all_gather", params * 4).seconds
        return exposed
    if strategy.pipeline > 1:  # gathered once, reduce-scattered once after the last backward
        group = _shard_group(strategy, cluster, where)
        gather = _dp_collective(cluster, group, "all_gather", params * activation_value_bytes(strategy)).seconds
        scatter = _dp_collective(cluster, group, "reduce_scatter", grads).seconds
        across = 0.0
        if strategy.sharding == "hsdp":
            replicas = Groups(1, n // group.dp_per_node, False)
            across = _dp_collective(cluster, replicas, "all_reduce", grads / group.dp_per_node).seconds
        return max(gather - forward, 0.0) + gather / max(1, len(stage.blocks)) + scatter + across
    return _sharded_exposed_s(strategy, cluster, stage, where, forward, backward)


# NCCL moves a collective's data with GPU kernels. Over NVLink or PCIe those kernels copy and reduce on the SMs and
# take memory bandwidth from the compute they overlap; over the network the NIC moves the data and the GPU little
# more than posts it. Calculon (systems/a100_80g.json, h100_80g_nvl8.json: "processor_usage") charges the compute
# 15% and 2% of the overlapped collective's time.
INTRA_NODE_COMPUTE_DRAG = 0.15
NETWORK_COMPUTE_DRAG = 0.02


@dataclass(frozen=True)
class _Comm:
    """One collective (or several in a row): its seconds, and the compute seconds it costs the kernels it runs
    beside, if it runs beside them all the way."""

    seconds: float
    drag_s: float

    def __add__(self, other: _Comm) -> _Comm:
        return _Comm(self.seconds + other.seconds, self.drag_s + other.drag_s)

    def exposed_beside(self, compute_s: float) -> float:
        """Seconds this adds to the ``compute_s`` it overlaps: what outlasts the compute, plus the compute's
        slowdown over the time they run together."""
        if self.seconds <= 0:
            return 0.0
        together = min(1.0, compute_s / self.seconds)
        return max(self.seconds - compute_s, 0.0) + self.drag_s * together


def _shard_group(strategy: Strategy, cluster: Cluster, where: Groups) -> Groups:
    """The ranks a sharded strategy gathers from and reduce-scatters over: the data-parallel group, or under HSDP
    the ranks of one node (its replicas sit on the other nodes)."""
    if strategy.sharding != "hsdp":
        return where
    return Groups(shard_degree(strategy, cluster.gpus_per_node), 1, where.pp_crosses_nodes)


def _dp_collective(cluster: Cluster, where: Groups, kind: Collective, size_bytes: float) -> _Comm:
    within, across = collective_parts_s(
        kind,
        size_bytes,
        ranks_per_node=where.dp_per_node,
        nodes=where.dp_nodes,
        intra=cluster.intra,
        inter=cluster.inter,
        gpus_per_node=cluster.gpus_per_node,
    )
    return _Comm(within + across, within * INTRA_NODE_COMPUTE_DRAG + across * NETWORK_COMPUTE_DRAG)


def _sharded_exposed_s(
    strategy: Strategy,
    cluster: Cluster,
    stage: Stage,
    where: Groups,
    forward: float,
    backward: float,
) -> float:
    """ZeRO-2, FSDP and HSDP as redline's runtime runs them: FSDP2 ``fully_shard`` on each block, then on the
    root (embedding, final norm, head), every micro-batch (it reduce-scatters every micro-batch and reshards
    after each backward).

    Unit by unit, since a collective hides only behind the compute that runs beside it: the root's and the first
    block's gathers start the forward with nothing to hide behind; each later block's gather runs beside the
    block before it (FSDP2 prefetches one unit). In the backward each block runs beside the next one's gather
    (FSDP re-gathers what it resharded after the forward; ZeRO-2 kept it) and the previous one's reduce-scatter;
    the last block's gather starts it and the last reduce-scatters (the first block's, the root's) end it with
    nothing beside them. Each collective pays its latency once per unit, so small units reach less than the
    link's bandwidth (``plan.comm``'s alpha-beta model). Overlapped, a collective slows the compute beside it
    (``INTRA_NODE_COMPUTE_DRAG``). HSDP shards within a node and, on the step's last micro-batch, all-reduces
    each unit's reduced shard across the nodes after its reduce-scatter. A block's compute is its FLOPs' share
    of the stage's, the same for every block (the head's and embedding's compute hides no block's collectives).
    """
    units = max(1, len(stage.blocks))
    block_flops = sum(block.forward_flops_per_sample for block in stage.blocks)
    all_flops = block_flops + sum(layer.forward_flops_per_sample for layer in stage.fixed)
    share = block_flops / all_flops / units if all_flops > 0 else 1.0 / units
    block_forward, block_backward = forward * share, backward * share
    value = activation_value_bytes(strategy)  # parameters are gathered in the compute precision
    unit_params = sum(block.params for block in stage.blocks) / strategy.tensor / units
    root_params = sum(layer.params for layer in stage.fixed) / strategy.tensor
    group = _shard_group(strategy, cluster, where)
    gather, root_gather = (_dp_collective(cluster, group, "all_gather", p * value) for p in (unit_params, root_params))
    scatter, root_scatter = (
        _dp_collective(cluster, group, "reduce_scatter", p * GRAD_REDUCE_BYTES) for p in (unit_params, root_params)
    )
    regather = gather if strategy.sharding != "zero2" else _Comm(0.0, 0.0)

    def micro_batch_s(scatter: _Comm, root_scatter: _Comm) -> float:
        forward_s = root_gather.seconds + gather.seconds + (units - 1) * gather.exposed_beside(block_forward)
        backward_s = (units - 1) * (regather + scatter).exposed_beside(block_backward)
        return forward_s + regather.seconds + backward_s + scatter.seconds + root_scatter.seconds

    m = strategy.accumulation
    if strategy.sharding != "hsdp":
        return m * micro_batch_s(scatter, root_scatter)
    replicas = Groups(1, strategy.data // group.dp_per_node, False)
    all_reduce, root_all_reduce = (
        _dp_collective(cluster, replicas, "all_reduce", p * GRAD_REDUCE_BYTES / group.dp_per_node)
        for p in (unit_params, root_params)
    )
    return (m - 1) * micro_batch_s(scatter, root_scatter) + micro_batch_s(
        scatter + all_reduce, root_scatter + root_all_reduce
    )


def _optimizer_s(profile: WorkloadProfile, strategy: Strategy, cluster: Cluster, stage: Stage) -> float:
    """A fused optimizer step is memory-bound: it streams the weights, gradients and states it owns
    (its shard under ZeRO-1 and above)."""
    opt_bytes = optimizer_bytes(profile, strategy)
    shard = shard_degree(strategy, cluster.gpus_per_node) if ZERO_STAGE[strategy.sharding] >= 1 else 1
    owned = stage.params / strategy.tensor / shard
    seconds = OPTIMIZER_TRAFFIC * owned * (4 + 4 + opt_bytes) / cluster.memory_bandwidth.value
    return seconds * (profile.calibration.optimizer_scale if profile.calibration is not None else 1.0)
