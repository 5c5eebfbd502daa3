"""Bytes of model states (weights, gradients, optimizer states) per GPU: pure functions, each citing its
source. Activations live in ``plan.memory``; these are the parts that scale with the parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from redline.errors import BadInput

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")

# Sharding of model states over the data-parallel group (ZeRO paper, Rajbhandari et al. 2020, section 5):
# ddp shards nothing; zero1 the optimizer states (PyTorch ZeroRedundancyOptimizer); zero2 also gradients
# (FSDP with reshard_after_forward=False); fsdp (ZeRO-3) also the parameters (FSDP2 fully_shard).
# hsdp is fsdp inside a node and replication across nodes (FSDP2 with a 2-D device mesh).
Sharding = Literal["ddp", "zero1", "zero2", "fsdp", "hsdp"]
SHARDINGS: tuple[str, ...] = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
ZERO_STAGE: dict[str, int] = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}

OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "adafactor", "adam8bit")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, before sharding.

    ``weights`` are the parameters as stored, ``master`` an extra fp32 copy where the stored parameters are
    16-bit (DeepSpeed/Megatron style), ``grads`` the gradients, ``optimizer`` the optimizer's states.
    """

    weights: float
    grads: float
    optimizer: float
    master: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.master


def optimizer_state_bytes(optimizer: str, *, hidden: int | None = None, ffn_hidden: int | None = None) -> float:
    """Bytes per parameter the optimizer keeps (EleutherAI "Transformer Math 101", 2023):

    - AdamW/Adam: fp32 first and second moments, 8;
    - SGD with momentum: one fp32 buffer, 4;
    - 8-bit Adam (bitsandbytes, Dettmers et al. 2022): two int8 moments, 2 (block-wise scales ignored);
    - Adafactor without momentum (Shazeer & Stern 2018): fp32 row and column statistics, 4(r + c) per
      r x c matrix, i.e. 4(1/h + 1/f) per parameter of an h x f weight; 0.01 when the shape is unknown.
    """
    if optimizer in ("adamw", "adam"):
        return 8.0
    if optimizer == "sgd":
        return 4.0
    if optimizer == "adam8bit":
        return 2.0
    if optimizer == "adafactor":
        if hidden and ffn_hidden:
            return 4.0 * (1 / hidden + 1 / ffn_hidden)
        return 0.01
    raise BadInput(f"unknown optimizer '{optimizer}'; known: {', '.join(OPTIMIZERS)}")


def pytorch_state_bytes(precision: str, optimizer_bytes: float) -> StateBytes:
    """Model states as PyTorch keeps them under ``torch.autocast`` (and FSDP2's MixedPrecisionPolicy with
    fp32 reductions): parameters and gradients stay fp32 whatever the compute precision, so there is no
    separate master copy. The 16-bit copies of the weights autocast or FSDP make for compute are counted
    separately (``plan.memory``), because how many exist at once depends on the sharding.
    """
    if precision not in PRECISIONS:
        raise BadInput(f"unknown precision '{precision}'; known: {', '.join(PRECISIONS)}")
    return StateBytes(weights=4.0, grads=4.0, optimizer=optimizer_bytes)


def zero_state_bytes(params: float, states: StateBytes, stage: int, dp: int) -> float:
    """Model-state bytes per GPU under ZeRO stage 0-3 over ``dp`` data-parallel ranks (ZeRO paper, Fig. 1):
    stage 1 shards optimizer states and master weights, stage 2 also gradients, stage 3 also weights.

    With the paper's mixed-precision accounting (weights 2, grads 2, K = 12) this gives 16Psi, 4Psi + 12Psi/N,
    2Psi + 14Psi/N and 16Psi/N.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, not {stage}")
    optimizer = states.optimizer + states.master
    sharded = optimizer if stage >= 1 else 0.0
    sharded += states.grads if stage >= 2 else 0.0
    sharded += states.weights if stage >= 3 else 0.0
    replicated = states.total - sharded
    return params * (replicated + sharded / dp)


def max_params_that_fit(memory_bytes: float, states: StateBytes, stage: int, dp: int) -> float:
    """The largest parameter count whose model states alone fit ``memory_bytes`` (ZeRO paper, Table 2)."""
    return memory_bytes / zero_state_bytes(1.0, states, stage, dp)
