"""One way to run a model: parallel degrees, sharding, precision, batch split and checkpointing.

The same fields are the CLI's options, the plan file's ``strategy`` section and what the runtime applies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from redline.plan.model_states import OPTIMIZERS, PRECISIONS, SHARDINGS

Checkpointing = Literal["none", "selective", "full"]
CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")
Schedule = Literal["gpipe", "1f1b", "interleaved"]
# GPipe (Huang et al. 2019): all forwards, then all backwards; 1F1B and its interleaved form (Narayanan et al.
# 2021, section 2.2): each stage alternates one forward and one backward once the pipeline is full, interleaved
# over ``virtual_stages`` chunks of layers per GPU
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Strategy:
    """How a training step is laid out over ``data x tensor x pipeline`` GPUs.

    Ranks are ordered tensor-innermost (tensor groups inside a node), then data, then pipeline, as
    Megatron-LM orders them.
    """

    data: int = 1  # data-parallel degree
    tensor: int = 1  # tensor-parallel degree (Megatron-style, within a node)
    pipeline: int = 1  # pipeline stages (run by ``schedule``)
    sharding: str = "ddp"  # ddp | zero1 | zero2 | fsdp | hsdp: what the data-parallel group shards
    precision: str = "bf16"  # fp32 | bf16 | fp16 | fp8: the matmuls' precision (autocast; fp32 uses TF32)
    micro_batch: int = 1  # samples per GPU per forward/backward
    accumulation: int = 1  # micro-batches per optimizer step (gradient accumulation; 1F1B micro-batches)
    checkpointing: str = "none"  # none | selective (attention core) | full (each block keeps its input)
    checkpoint_every: int = 1  # checkpoint every k-th repeated block a rank holds (k-th, 2k-th...); 1: each
    sequence_parallel: bool = False  # shard norms and dropout along the sequence in tensor-parallel groups
    optimizer: str = "adamw"
    flash_attention: bool = True  # attention through SDPA/FlashAttention: no s x s matrices kept
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved: the pipeline schedule (SCHEDULES)
    virtual_stages: int = 1  # interleaved 1F1B: chunks of layers per pipeline rank (v; 1 otherwise)

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "micro_batch", "accumulation", "virtual_stages", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Strategy.{name} must be a positive integer, not {value!r}")
        for name, known in (
            ("sharding", SHARDINGS),
            ("precision", PRECISIONS),
            ("checkpointing", CHECKPOINTING),
            ("optimizer", OPTIMIZERS),
            ("schedule", SCHEDULES),
        ):
            if getattr(self, name) not in known:
                raise ValueError(f"Strategy.{name} '{getattr(self, name)}' is not one of {', '.join(known)}")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence parallelism needs tensor parallelism (tensor > 1)")
        if self.schedule == "interleaved" and (self.pipeline == 1 or self.virtual_stages == 1):
            raise ValueError("the interleaved schedule needs pipeline > 1 and virtual_stages > 1")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(
                f"virtual_stages {self.virtual_stages} needs the interleaved schedule, not {self.schedule}"
            )

    @property
    def gpus(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def global_batch(self) -> int:
        return self.data * self.micro_batch * self.accumulation

    def label(self) -> str:
        """Short human form: 'fsdp dp8 tp2 pp4:interleavedx2 mb4x8 bf16 ckpt=full' (the schedule and its virtual
        stages with a pipeline; 'ckpt=full/2' checkpoints every second block; '-flash' where it is off)."""
        parts = [self.sharding, f"dp{self.data}"]
        if self.tensor > 1:
            parts.append(f"tp{self.tensor}" + ("+sp" if self.sequence_parallel else ""))
        if self.pipeline > 1:
            virtual = f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pipeline}:{self.schedule}{virtual}")
        parts += [f"mb{self.micro_batch}x{self.accumulation}", self.precision]
        if self.checkpointing != "none":
            parts.append(
                f"ckpt={self.checkpointing}" + (f"/{self.checkpoint_every}" if self.checkpoint_every > 1 else "")
            )
        if not self.flash_attention:
            parts.append("-flash")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown strategy fields: {', '.join(sorted(unknown))}")
        return cls(**data)
