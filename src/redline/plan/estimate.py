"""Everything the planner predicts for one strategy: memory, step time, throughput, MFU, time and cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redline.plan.hardware import Cluster
from redline.plan.memory import Footprints, MemoryBreakdown, memory_per_gpu
from redline.plan.messages import check_whole, refuse, refuse_field
from redline.plan.steptime import StepTime, recomputed_flops_per_sample, step_time
from redline.plan.strategy import Strategy
from redline.specs.catalog import peak_precisions
from redline.workload.profile import WorkloadProfile


@dataclass(frozen=True)
class Goal:
    """What the plans are for: a global batch per step, and how much training in all (for the time to train and
    its cost). ``inputs.Target`` is the same before the defaults, as the user gives it."""

    global_batch: int
    tokens: float | None = None  # train on this many tokens
    samples: float | None = None  # or on this many samples (epochs x dataset size)

    def __post_init__(self) -> None:
        check_whole("global_batch", self.global_batch, 1)
        for name in ("tokens", "samples"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # NaN too
                raise refuse_field(name, "must be positive, not {value}", value=value)
        if self.tokens is not None and self.samples is not None:
            raise refuse("give {tokens} or {samples}, not both")


def model_flops_utilization(
    flops_per_sample: float | None, samples_per_s: float, devices: int, peak_flops: float | None
) -> float | None:
    """PaLM's model FLOPs utilisation (Chowdhery et al. 2022, appendix B): the model's FLOPs per second over
    the devices' peak,

        mfu = flops_per_sample x samples_per_s / (devices x peak_flops)

    with ``flops_per_sample`` the training FLOPs of one sample (3 x forward; recomputation is not model work,
    it makes the hardware FLOPs utilisation when counted in), ``samples_per_s`` over all the devices and
    ``peak_flops`` one device's. None when the FLOPs or the peak is unknown (None or 0). The planner's
    prediction and the runtime's measured steps both compute theirs here."""
    if not flops_per_sample or not peak_flops:
        return None
    return flops_per_sample * samples_per_s / (devices * peak_flops)


def mfu_peak(cluster: Cluster, precision: str) -> float | None:
    """MFU's denominator: the dense datasheet peak of the precision the matmuls run in (TF32 for fp32, bf16
    for fp8: ``specs.catalog.peak_precisions``)."""
    return next((cluster.peak_flops[k] for k in peak_precisions(precision) if k in cluster.peak_flops), None)


@dataclass(frozen=True)
class Estimate:
    strategy: Strategy
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    samples_per_s: float
    tokens_per_s: float
    mfu: float | None  # model FLOPs (3 x forward) per second over the GPUs' dense peak (PaLM's definition)
    hfu: float | None  # the same with recomputation counted (hardware FLOPs)
    time_to_train_s: float | None
    cost_usd: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.to_dict(),
            "label": self.strategy.label(),
            "fits": self.fits,
            "memory_bytes": self.memory.to_dict(),
            "step_time_s": self.time.to_dict(),
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "time_to_train_s": self.time_to_train_s,
            "cost_usd": self.cost_usd,
        }


def estimate(
    profile: WorkloadProfile,
    strategy: Strategy,
    cluster: Cluster,
    goal: Goal,
    *,
    memory_margin: float = 0.0,
    footprints: Footprints | None = None,
) -> Estimate:
    """The strategy's predictions; it fits when its device total leaves ``memory_margin`` of the GPU's memory
    free. ``footprints`` (of this profile) remembers the memory of strategies estimated before."""
    if footprints is not None:
        memory = footprints.of(strategy, cluster.gpus_per_node, cpu=cluster.on_cpu)
    else:
        memory = memory_per_gpu(profile, strategy, cluster.gpus_per_node, cpu=cluster.on_cpu)
    time = step_time(profile, strategy, cluster)
    step_s = time.total
    samples_per_s = strategy.global_batch / step_s
    tokens_per_s = samples_per_s * profile.tokens_per_sample
    peak = mfu_peak(cluster, strategy.precision)
    flops = profile.training_flops_per_sample
    mfu = model_flops_utilization(flops, samples_per_s, strategy.gpus, peak)
    hfu = model_flops_utilization(
        flops + recomputed_flops_per_sample(profile, strategy), samples_per_s, strategy.gpus, peak
    )
    time_to_train = None
    if goal.tokens is not None:
        time_to_train = goal.tokens / tokens_per_s
    elif goal.samples is not None:
        time_to_train = goal.samples / samples_per_s
    cost = None
    if time_to_train is not None and cluster.price_usd_per_node_hour is not None:
        cost = time_to_train / 3600 * cluster.nodes * cluster.price_usd_per_node_hour
    return Estimate(
        strategy=strategy,
        memory=memory,
        time=time,
        fits=memory.device_total <= (1 - memory_margin) * cluster.memory_bytes,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        hfu=hfu,
        time_to_train_s=time_to_train,
        cost_usd=cost,
    )
