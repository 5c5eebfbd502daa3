"""Enumerate the ways to run a model on a cluster, drop the ones that cannot run, rank the rest.

The space: tensor degree (a divisor of the node size that divides the attention heads), pipeline degree
(a divisor of what is left, no deeper than the model has blocks), data degree (the rest), what the data-
parallel group shards, micro-batch (powers of two and the whole per-rank batch), the gradient
accumulation that reaches the global batch, and activation checkpointing (none, selective, full).
Sequence parallelism is on whenever tensor parallelism is (it only saves memory) unless the user turns it
off; pipelines run 1F1B unless the user picks a schedule. Everything is arithmetic: a 70B model over 64
GPUs is a few thousand candidates.

A plan fits when its predicted device total leaves ``Constraints.memory_margin`` of the GPU's memory free
(none by default: the prediction already counts the allocator's reserve, the CUDA context and NCCL's
buffers). Plans rank by time; but where the fastest leaves less than ``TIGHT_HEADROOM`` of the memory
free, those within ``Constraints.time_tolerance`` of it rank by memory headroom, more free memory first: a
0.2% faster plan is not worth running at the edge of memory.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from redline.errors import BadInput
from redline.plan.estimate import Estimate, Goal, estimate
from redline.plan.hardware import Cluster
from redline.plan.memory import Footprints
from redline.plan.messages import check_choice, check_whole, refuse
from redline.plan.model_states import OPTIMIZERS, PRECISIONS, SHARDINGS
from redline.plan.strategy import CHECKPOINTING, SCHEDULES, Strategy
from redline.units import GiB
from redline.workload.profile import WorkloadProfile

OUT_OF_MEMORY = "does not fit in GPU memory"
# the candidates that came nearest to fitting a search keeps, for a refusal to show (``redline plan --json``)
CLOSEST_KEPT = 5
# `redline plan` ranks plans within 1% of the fastest by memory headroom: less than the planner's own error on the
# published runs (benchmarks/plan_vs_published.py), so such a difference in time is no reason to run at the edge
TIME_TOLERANCE = 0.01
# a plan that leaves less than a tenth of the GPU's memory free runs at the edge: the allocator's reserve in the
# prediction (5%) is a typical figure, and a long run's fragmentation or an unusual batch can exceed it
TIGHT_HEADROOM = 0.10
# activation checkpointing of every k-th block (torchtitan's selective AC "k"): half or a quarter of the
# recomputation where checkpointing every block would leave memory unused
CHECKPOINT_EVERY = (1, 2, 4)
# the 16-bit precisions a plan trains in by default where the device runs them faster than fp32, preferred first:
# bf16 needs no loss scaling, fp16 (Volta, Turing) does
REDUCED_PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class Constraints:
    """Parts of the strategy the user fixed (None leaves them to the search), and how the search judges the
    candidates. Each field is checked as the constraints are made: ``PlanInputError`` names the field and what it
    may be (``redline plan`` says the field's flag in the same words)."""

    precision: str | None = None  # one of model_states.PRECISIONS; None: default_precision (bf16, fp16 or fp32)
    optimizer: str = "adamw"  # one of model_states.OPTIMIZERS
    sharding: str | None = None  # one of model_states.SHARDINGS
    tensor: int | None = None  # tensor-parallel degree, at least 1
    pipeline: int | None = None  # pipeline stages, at least 1
    micro_batch: int | None = None  # samples per micro-batch and data-parallel rank, at least 1
    accumulation: int | None = None  # micro-batches per optimizer step, at least 1
    checkpointing: str | None = None  # one of strategy.CHECKPOINTING
    checkpoint_every: int | None = None  # checkpoint every k-th block; None: the search tries CHECKPOINT_EVERY
    sequence_parallel: bool = True  # wherever tensor parallelism is
    flash_attention: bool = True
    schedule: str | None = None  # of a pipeline, one of strategy.SCHEDULES; None: 1F1B
    virtual_stages: int | None = None  # of the interleaved schedule, at least 2; None: 2
    memory_margin: float = 0.0  # fraction of each GPU's memory a plan leaves free, in [0, 1)
    time_tolerance: float = 0.0  # plans this close to the fastest (a fraction of its time) rank by headroom

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("sharding", self.sharding, SHARDINGS)
        check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        for name in ("tensor", "pipeline", "micro_batch", "accumulation", "checkpoint_every"):
            check_whole(name, getattr(self, name), 1)
        if self.checkpoint_every not in (None, 1) and self.checkpointing == "none":
            raise refuse("{checkpoint_every} checkpoints some blocks: it goes with {checkpointing} selective or full")
        check_choice("schedule", self.schedule, SCHEDULES)
        if self.virtual_stages is not None:
            if self.schedule != "interleaved":
                raise refuse("{virtual_stages} goes with {schedule} interleaved")
            check_whole("virtual_stages", self.virtual_stages, 2)
        if not 0 <= self.memory_margin < 1:  # NaN too
            raise refuse(
                "{memory_margin} must be a fraction from 0 to below 1 (0.05 = 5%), not {value}",
                value=self.memory_margin,
            )
        if not self.time_tolerance >= 0:
            raise refuse("{time_tolerance} must not be negative, not {value}", value=self.time_tolerance)


@dataclass
class SearchResult:
    ranked: list[Estimate]  # strategies that fit, best first
    considered: int
    excluded: Counter[str] = field(default_factory=Counter)  # reason -> how many
    # the strategies excluded for memory that came nearest to fitting (the ``CLOSEST_KEPT`` smallest), nearest first
    closest_misfits: list[Estimate] = field(default_factory=list)
    memory_margin: float = 0.0  # the fraction of each GPU's memory the plans were to leave free

    @property
    def closest_misfit(self) -> Estimate | None:
        """The excluded strategy that came nearest to fitting (the first searched of equals), or None."""
        return self.closest_misfits[0] if self.closest_misfits else None

    def exclusions(self) -> list[dict[str, Any]]:
        return [{"reason": reason, "count": count} for reason, count in self.excluded.most_common()]


def slower_than_fp32(cluster: Cluster) -> tuple[str, ...]:
    """The 16-bit precisions whose matmul ceiling on ``cluster`` is below fp32's: a CPU without bf16 units (no
    AVX512-BF16, no AMX), where oneDNN converts every product to fp32 and ``redline bench compute`` measures bf16
    20 to 250 times slower. No catalog GPU is among them (each runs 16 bits at least at its TF32 rate)."""
    fp32 = cluster.matmul.get("fp32")
    if fp32 is None:
        return ()
    return tuple(p for p in REDUCED_PRECISIONS if p in cluster.matmul and cluster.matmul[p].value < fp32.value)


def default_precision(cluster: Cluster) -> str:
    """bf16 where the device has it, fp16 on Volta/Turing, fp32 otherwise (a CPU measured only in fp32). A 16-bit
    precision is there to be faster: where it runs slower than fp32 (``slower_than_fp32``) it is passed over,
    since every step of a plan in it would crawl."""
    slow = slower_than_fp32(cluster)
    for precision in (*REDUCED_PRECISIONS, "fp32"):
        if precision in cluster.matmul and precision not in slow:
            return precision
    raise BadInput(f"{cluster.name}: no measured or catalog matmul rate for any training precision")


def default_global_batch(profile: WorkloadProfile, gpus: int = 1) -> int:
    """About half a million tokens per step for language models (GPT-3's smaller models used 0.5M), as a
    power of two; 256 images for vision models; rounded up to a multiple of ``gpus``."""
    if profile.sample_unit == "sequence":
        wanted = 2 ** max(0, round(math.log2(2**19 / profile.tokens_per_sample)))
    else:
        wanted = 256
    return max(gpus, -(-wanted // gpus) * gpus)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(per_rank: int) -> list[int]:
    sizes = {b for b in (2**i for i in range(per_rank.bit_length())) if per_rank % b == 0}
    sizes.add(per_rank)
    return sorted(sizes)


def _micro_batch_choices(per_rank: int, constraints: Constraints, excluded: Counter[str]) -> list[int]:
    """The micro-batches to try for a per-rank batch: powers of two that divide it and itself, or the one that
    --micro-batch or --accumulation fixes; none (counted in ``excluded``) where the fixed one cannot be."""
    fixed = constraints.micro_batch
    if fixed is not None and per_rank % fixed:
        excluded[f"--micro-batch {fixed} does not divide the per-rank batch"] += 1
        return []
    if constraints.accumulation is not None:
        if per_rank % constraints.accumulation:
            excluded[f"--accumulation {constraints.accumulation} does not divide the per-rank batch"] += 1
            return []
        if fixed not in (None, per_rank // constraints.accumulation):
            excluded["--micro-batch x --accumulation is not the per-rank batch"] += 1
            return []
        fixed = per_rank // constraints.accumulation
    return [fixed] if fixed is not None else _micro_batches(per_rank)


def candidates(
    profile: WorkloadProfile, cluster: Cluster, goal: Goal, constraints: Constraints, excluded: Counter[str]
) -> Iterator[Strategy]:
    """Every strategy worth estimating; the ones impossible by construction are counted in ``excluded``."""
    shape = profile.transformer
    blocks = len(profile.blocks)
    precision = constraints.precision or default_precision(cluster)
    if precision not in cluster.matmul:
        raise BadInput(
            f"{cluster.device} has no {precision} rate (catalog or measured); try: {', '.join(cluster.matmul)}"
        )
    n = cluster.gpus
    _check_against(constraints, cluster, blocks)
    tensors = _divisors(cluster.gpus_per_node)
    for t in tensors:
        if constraints.tensor is not None and t != constraints.tensor:
            continue
        if t > 1 and shape is None:
            excluded["tensor parallelism needs a transformer"] += 1
            continue
        if t > 1 and shape is not None and (shape.heads % t or shape.groups % t):
            excluded[f"tensor degree {t} does not divide the attention heads"] += 1
            continue
        for p in _divisors(n // t):
            if constraints.pipeline is not None and p != constraints.pipeline:
                continue
            if p > max(blocks, 1):
                excluded["more pipeline stages than the model has blocks"] += 1
                continue
            dp = n // (t * p)
            per_node = cluster.gpus_per_node // t
            if dp > per_node and dp % per_node:
                excluded["data-parallel groups would straddle nodes unevenly"] += 1
                continue
            if goal.global_batch % dp:
                excluded["global batch not divisible by the data-parallel degree"] += 1
                continue
            per_rank = goal.global_batch // dp
            shardings = _shardings(dp, t, p, per_node)
            if constraints.sharding is not None:
                if constraints.sharding not in shardings:
                    why = "data parallelism across this layout" if dp == 1 else "no tensor or pipeline parallelism"
                    excluded[f"--sharding {constraints.sharding} needs {why}"] += 1
                    continue
                shardings = [constraints.sharding]
            micro_batches = _micro_batch_choices(per_rank, constraints, excluded)
            if not micro_batches:
                continue
            layout = Strategy(data=dp, tensor=t, pipeline=p, precision=precision, optimizer=constraints.optimizer)
            yield from _strategies(layout, constraints, shardings, micro_batches, per_rank, blocks, excluded)


def _check_against(constraints: Constraints, cluster: Cluster, blocks: int) -> None:
    """The fixed degrees and sharding against this cluster and model: a tensor degree that does not divide a node,
    a pipeline deeper than the model or not dividing the GPUs, HSDP on one node."""
    tensor, pipeline = constraints.tensor, constraints.pipeline
    if tensor is not None and cluster.gpus_per_node % tensor:
        raise refuse("{tensor} {t} does not divide the {n} GPUs of a node", t=tensor, n=cluster.gpus_per_node)
    if pipeline is not None:
        if pipeline > max(blocks, 1):
            raise refuse("{pipeline} {p}: more pipeline stages than the model has blocks ({b})", p=pipeline, b=blocks)
        if cluster.gpus % pipeline:
            raise refuse("{pipeline} {p} does not divide the {n} GPUs", p=pipeline, n=cluster.gpus)
    if constraints.sharding == "hsdp" and cluster.nodes == 1:
        raise refuse("{sharding} hsdp shards inside a node and replicates across nodes: it needs {nodes} > 1")


def _shardings(dp: int, tensor: int, pipeline: int, per_node: int) -> list[str]:
    """How the data-parallel ranks may hold the model states, as the runtime runs them: beside tensor or pipeline
    parallelism always FSDP2 over the data ranks (DDP takes no DTensor parameters and no pipeline stage), keeping
    the parameters gathered after the forward (zero2) or not (fsdp); HSDP without either, across nodes."""
    if dp == 1:
        return ["ddp"]
    if tensor > 1 or pipeline > 1:
        return ["zero2", "fsdp"]
    return ["ddp", "zero1", "zero2", "fsdp"] + (["hsdp"] if dp > per_node else [])  # HSDP: shard in a node


def _strategies(
    layout: Strategy,
    constraints: Constraints,
    shardings: list[str],
    micro_batches: list[int],
    per_rank: int,
    blocks: int,
    excluded: Counter[str],
) -> Iterator[Strategy]:
    """The candidates of one layout (degrees, precision, optimizer) for ``per_rank`` samples per data-parallel rank
    and step: each sharding, micro-batch and checkpointing, with the user's switches and the pipeline's schedule."""
    t, p = layout.tensor, layout.pipeline
    schedule, virtual = _schedule(constraints, p)
    if p * virtual > max(blocks, 1):
        excluded["fewer blocks than pipeline stages x virtual stages"] += 1
        return
    for sharding in shardings:
        for b in micro_batches:
            if schedule == "interleaved" and (per_rank // b) % p:
                # Megatron-LM and torch.distributed.pipelining's interleaved 1F1B alike
                excluded["interleaved: micro-batches per step not a multiple of the pipeline stages"] += 1
                continue
            if schedule == "1f1b" and p > 1 and per_rank // b < p:
                # torch.distributed.pipelining's 1F1B refuses it (and its bubble would be most of the step)
                excluded["1F1B: fewer micro-batches per step than pipeline stages"] += 1
                continue
            for ckpt, every in _checkpointing(constraints, blocks // (p * virtual), excluded):
                yield replace(
                    layout,
                    sharding=sharding,
                    micro_batch=b,
                    accumulation=per_rank // b,
                    checkpointing=ckpt,
                    checkpoint_every=every,
                    sequence_parallel=t > 1 and constraints.sequence_parallel,
                    flash_attention=constraints.flash_attention,
                    schedule=schedule,
                    virtual_stages=virtual,
                )


def _checkpointing(
    constraints: Constraints, blocks_per_chunk: int, excluded: Counter[str]
) -> Iterator[tuple[str, int]]:
    """Each activation checkpointing and how many of the blocks it covers: none; selective and full over every
    block, or every k-th (CHECKPOINT_EVERY, no more than a pipeline chunk's blocks, so that each covers one),
    between which a plan that nearly fits recomputes less. The user's choices fix either."""
    if blocks_per_chunk == 0:
        yield "none", 1
        return
    for ckpt in CHECKPOINTING:
        if constraints.checkpointing not in (None, ckpt):
            continue
        if ckpt == "none":
            if constraints.checkpoint_every in (None, 1):
                yield ckpt, 1
            continue
        for every in (constraints.checkpoint_every,) if constraints.checkpoint_every else CHECKPOINT_EVERY:
            if every <= blocks_per_chunk:
                yield ckpt, every
            elif constraints.checkpoint_every:
                excluded[f"--ac-every {every}: a pipeline rank holds {blocks_per_chunk} blocks"] += 1


def _schedule(constraints: Constraints, pipeline: int) -> tuple[str, int]:
    """The schedule and virtual stages of a pipeline of ``pipeline`` stages: the user's, or 1F1B; without a
    pipeline there is nothing to schedule."""
    if pipeline == 1 or constraints.schedule in (None, "1f1b"):
        return "1f1b", 1
    if constraints.schedule == "interleaved":
        return "interleaved", constraints.virtual_stages or 2
    return constraints.schedule, 1


def search(
    profile: WorkloadProfile,
    cluster: Cluster,
    goal: Goal,
    constraints: Constraints | None = None,
    *,
    footprints: Footprints | None = None,
) -> SearchResult:
    """Estimate every candidate; keep those that fit, fastest (or cheapest) first. ``footprints`` (of this
    profile) carries the memory of strategies from one search to the next, over clusters of one workload."""
    constraints = constraints or Constraints()
    excluded: Counter[str] = Counter()
    fitting: list[Estimate] = []
    closest: list[Estimate] = []  # the misfits nearest to fitting, smallest device total first
    considered = 0
    for strategy in candidates(profile, cluster, goal, constraints, excluded):
        considered += 1
        result = estimate(
            profile, strategy, cluster, goal, memory_margin=constraints.memory_margin, footprints=footprints
        )
        if result.fits:
            fitting.append(result)
            continue
        excluded[OUT_OF_MEMORY] += 1
        if len(closest) < CLOSEST_KEPT or result.memory.device_total < closest[-1].memory.device_total:
            bisect.insort(closest, result, key=lambda e: e.memory.device_total)  # after equals: first searched first
            del closest[CLOSEST_KEPT:]
    ranked = rank(fitting, constraints.time_tolerance, cluster.memory_bytes)
    return SearchResult(
        ranked=ranked,
        considered=considered,
        excluded=excluded,
        closest_misfits=closest,
        memory_margin=constraints.memory_margin,
    )


def rank(fitting: list[Estimate], time_tolerance: float, memory_bytes: float) -> list[Estimate]:
    """Fastest first (on one cluster cost is time x price, so one order serves both; equal times: more memory to
    spare first). Where the fastest leaves less than ``TIGHT_HEADROOM`` of ``memory_bytes`` free, the plans within
    ``time_tolerance`` of it rank by memory headroom, more free memory first."""
    ordered = sorted(fitting, key=lambda e: (e.time.total, e.memory.device_total))
    if not ordered or ordered[0].memory.device_total < (1 - TIGHT_HEADROOM) * memory_bytes:
        return ordered
    limit = ordered[0].time.total * (1 + time_tolerance)
    close = [e for e in ordered if e.time.total <= limit]  # a prefix: ordered by time
    return sorted(close, key=lambda e: (e.memory.device_total, e.time.total)) + ordered[len(close) :]


def explain_no_fit(result: SearchResult, cluster: Cluster) -> str:
    """Why nothing fits, in one line."""
    if result.closest_misfit is None:
        reasons = "; ".join(f"{r['reason']} ({r['count']})" for r in result.exclusions()) or "no candidates"
        return f"no strategy can run on {cluster.name}: {reasons}"
    best = result.closest_misfit
    margin = f" less the {result.memory_margin:.0%} margin" if result.memory_margin else ""
    return (
        f"nothing fits on {cluster.name}: the smallest footprint ({best.strategy.label()}) needs "
        f"{best.memory.device_total / GiB:.1f} GiB per GPU of {cluster.memory_bytes / GiB:.1f} GiB{margin}"
    )


# the layout a user can pin, by the `redline plan` flag that pins each: what a refusal may ask to leave to the
# search (precision, optimizer, sequence parallelism and the attention kernel are the run's own terms: kept)
LAYOUT_FLAGS = {
    "tensor": "--tp",
    "pipeline": "--pp",
    "sharding": "--sharding",
    "micro_batch": "--micro-batch",
    "accumulation": "--accumulation",
    "checkpointing": "--checkpointing",
    "checkpoint_every": "--ac-every",
    "schedule": "--schedule",
    "virtual_stages": "--virtual-stages",
}


def fit_without_pins(
    profile: WorkloadProfile, cluster: Cluster, goal: Goal, constraints: Constraints
) -> tuple[list[str], Estimate] | None:
    """Where the pinned layout fits nowhere on ``cluster`` but a free one does: the pins in the way (as flags with
    their values, those the best free strategy does not share) and that strategy. None when nothing was pinned
    or nothing fits here even free (then other hardware is the answer)."""
    pinned = {name: getattr(constraints, name) for name in LAYOUT_FLAGS if getattr(constraints, name) is not None}
    if not pinned:
        return None
    try:
        free = replace(
            constraints,
            tensor=None,
            pipeline=None,
            sharding=None,
            micro_batch=None,
            accumulation=None,
            checkpointing=None,
            checkpoint_every=None,
            schedule=None,
            virtual_stages=None,
        )
        result = search(profile, cluster, goal, free)
    except BadInput:
        return None
    if not result.ranked:
        return None
    best = result.ranked[0]
    differ = [name for name, value in pinned.items() if getattr(best.strategy, name) != value] or list(pinned)
    return [f"{LAYOUT_FLAGS[name]} {pinned[name]}" for name in differ], best


# the GPU counts tried when looking for the smallest hardware that fits: one node of 1-8, then whole nodes
HARDWARE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def smallest_fitting(
    profile: WorkloadProfile, goal: Goal, constraints: Constraints, *, limit: int = 3, prefer: str | None = None
) -> list[tuple[Cluster, Estimate]]:
    """For each catalog GPU, the fewest GPUs (8 per node) on which the model fits with its leanest
    strategy (micro-batch 1, full checkpointing); the ``limit`` smallest by total GPU memory, the ``prefer`` GPU
    (the one the user asked for: more of it is the first answer) first."""
    from redline.plan.hardware import catalog_cluster
    from redline.specs.catalog import gpu_catalog

    lean = replace(constraints, micro_batch=1, checkpointing="full" if profile.blocks else None)
    found: list[tuple[Cluster, Estimate]] = []
    footprints = Footprints(profile)
    for gpu in gpu_catalog():
        if gpu.vendor != "NVIDIA":
            continue
        for total in HARDWARE_SIZES:
            per_node = min(total, 8)
            cluster = catalog_cluster(gpu, per_node, name=f"{per_node}x{gpu.key}").with_nodes(total // per_node)
            batch = max(goal.global_batch, total)
            sized = replace(goal, global_batch=-(-batch // total) * total)
            try:
                result = search(profile, cluster, sized, lean, footprints=footprints)
            except BadInput:
                continue  # this size cannot take the user's --tp/--pp (or the GPU lacks the precision)
            if result.ranked:
                found.append((cluster, result.ranked[0]))
                break
    found.sort(
        key=lambda pair: (
            pair[0].gpu is None or pair[0].gpu.key != prefer,
            pair[0].gpus * pair[0].memory_bytes,
            pair[0].gpus,
        )
    )
    return found[:limit]
