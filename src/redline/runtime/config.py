"""What the runtime applies: the plan's strategy plus the settings only a running job needs.

``RunConfig`` is the runtime's slice of the one config tree: the plan file's ``strategy`` section (the
same ``Strategy`` the planner ranks) and runtime switches with defaults that suit most jobs. It comes
from a plan file, an explicit object, or defaults for the probed hardware; the checks in
``__post_init__`` run before any training starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.errors import BadInput
from redline.plan.strategy import Strategy

COMM_HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class RunConfig:
    strategy: Strategy = field(default_factory=Strategy)
    # numerics and kernels
    tf32: bool = True  # TF32 matmuls and convolutions on Ampere and newer (fp32 plans run on TF32 tensor cores)
    cudnn_benchmark: bool = True  # pick the fastest convolution algorithm per input shape
    compile: bool = False  # torch.compile each block (then the whole model when it has none)
    grad_clip_norm: float | None = None  # clip the global gradient norm before each optimizer step
    seed: int = 0  # sampler shuffling (and nothing else: the user seeds their own model)
    # DistributedDataParallel
    ddp_bucket_cap_mb: int = 25
    ddp_static_graph: bool = False
    comm_hook: str = "none"  # compress DDP's all-reduce: fp16/bf16, or PowerSGD for slow inter-node links
    powersgd_rank: int = 4
    sync_batchnorm: bool = True  # on several GPUs, BatchNorm normalises over the global batch (SyncBatchNorm)
    shard_stream: bool = True  # an IterableDataset is shared over ranks and workers; False: it shards itself
    # DataLoader: None keeps what the user's loader has
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    # a loader with workers and no timeout of its own that gives no batch for this long ends the run, naming
    # the worker that owes the batch; 0: wait forever
    loader_stall_s: float = 300.0
    # checkpoints and metrics
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: only at the end
    metrics_path: str | None = None  # JSON lines, one per optimizer step
    metrics_interval_s: float = 10.0
    # from the plan: what the planner predicted, and the model's FLOPs for MFU
    predicted: dict[str, Any] | None = None
    training_flops_per_sample: float | None = None
    tokens_per_sample: int = 1
    planned_device: str | None = None  # the device the plan was made for ("NVIDIA H100 SXM5 80GB", "cpu")
    planned_params: int | None = None  # the model's parameters as the planner counted them

    def __post_init__(self) -> None:
        check_runnable(self.strategy)
        if self.comm_hook not in COMM_HOOKS:
            raise BadInput(f"comm_hook '{self.comm_hook}' is not one of {', '.join(COMM_HOOKS)}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise BadInput(f"grad_clip_norm must be positive, not {self.grad_clip_norm}")
        if self.loader_stall_s < 0:
            raise BadInput(f"loader_stall_s must be 0 (no limit) or more, not {self.loader_stall_s}")
        if self.checkpoint_every < 0:
            raise BadInput(f"checkpoint_every must be 0 or more, not {self.checkpoint_every}")

    @property
    def per_rank_batch(self) -> int:
        """Samples each rank loads per optimizer step: micro-batch x accumulation."""
        return self.strategy.micro_batch * self.strategy.accumulation

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


def check_runnable(strategy: Strategy, where: str = "the plan") -> None:
    """What the runtime cannot apply yet, refused before training (and by ``redline run`` before any rank
    starts)."""
    if strategy.tensor > 1 or strategy.pipeline > 1:
        raise BadInput(
            f"{where} asks for tensor degree {strategy.tensor} and pipeline degree {strategy.pipeline}; redline's "
            "runtime applies data parallelism (DDP, ZeRO, FSDP) only so far: plan with --tp 1 --pp 1"
        )
    if strategy.precision == "fp8":
        raise BadInput(f"{where}: fp8 training is not supported by redline's runtime yet: plan with --precision bf16")


def from_plan_file(path: str | Path, **overrides: Any) -> RunConfig:
    """A RunConfig from a plan file written by ``redline plan -o``; ``overrides`` set runtime fields."""
    from redline.plan.planfile import load_plan

    plan = load_plan(Path(path))
    model = plan.model
    return RunConfig(
        strategy=plan.strategy,
        predicted=plan.predicted,
        training_flops_per_sample=model.get("training_flops_per_sample"),
        tokens_per_sample=int(model.get("tokens_per_sample") or 1),
        planned_device=_planned_device(plan.hardware or {}),
        planned_params=model.get("params"),
        **overrides,
    )


def default_config(world_size: int, per_rank_batch: int, *, cuda: bool, bf16: bool) -> RunConfig:
    """Without a plan: plain data parallelism over the ranks there are, the user's batch as one micro-batch,
    bf16 autocast where the GPU has it, fp32 on a CPU."""
    precision = "bf16" if cuda and bf16 else ("fp16" if cuda else "fp32")
    return RunConfig(strategy=Strategy(data=world_size, micro_batch=per_rank_batch, precision=precision))


def _planned_device(hardware: dict[str, Any]) -> str | None:
    """The GPU's name a plan was made for, or "cpu" (a plan for ``--hardware local`` on a machine without one)."""
    if hardware.get("accelerator") == "cpu":
        return "cpu"
    return hardware.get("device")
