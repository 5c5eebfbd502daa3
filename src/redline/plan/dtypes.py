"""The dtypes a training step keeps its activations in, as redline's runtime runs a strategy.

A 16-bit plan runs under autocast (``runtime.prepare``), which computes matmuls in 16 bits and leaves the model's
parameters fp32: an embedding's output is fp32, each residual add (the fp32 stream plus a 16-bit branch) promotes,
and the residual stream between a transformer's blocks stays fp32. Where the runtime shards the model with FSDP2
(``runtime.parallelize.apply_fsdp``), its ``MixedPrecisionPolicy(param_dtype=bf16)`` makes the parameters
themselves 16-bit: the stream is 16-bit from the embedding on. Megatron-LM keeps a bf16 stream under every
sharding; ``TransformerShape.residual_bytes`` fixes the width for a plan made for such a framework.

What a norm saves of the stream follows the norm as PyTorch runs it under CUDA's autocast: ``layer_norm`` is on
its fp32 list, so a LayerNorm saves an fp32 copy of a 16-bit stream (4 bytes a value either way); an RMSNorm
written as Hugging Face's (an fp32 upcast, then a product cast back to the stream's type) saves the narrower
product; and a post-norm block's output, the stream itself, is a LayerNorm's: fp32 under FSDP2 too. Measured on
the CPU under ``workload.cuda_autocast``'s policy, a tiny GPT-2 block saved the same bytes with a bf16 stream as
with an fp32 one; a tiny Llama block 19% less.
"""

from __future__ import annotations

from dataclasses import replace

from redline.plan.messages import check_integral, refuse
from redline.plan.model_states import ZERO_STAGE
from redline.plan.strategy import Strategy
from redline.workload.profile import LayerProfile, TransformerShape, WorkloadProfile

# the stream's width under autocast alone, as the tracer measures a profile's 16-bit figures
AUTOCAST_STREAM_BYTES = 4


def activation_value_bytes(strategy: Strategy) -> int:
    """Bytes of one activation value: fp32 without mixed precision, 16-bit under autocast (and fp8)."""
    return 4 if strategy.precision == "fp32" else 2


def activation_key(strategy: Strategy) -> str:
    """Which of a LayerProfile's activation figures applies: "fp32" or "16bit"."""
    return "fp32" if strategy.precision == "fp32" else "16bit"


def fsdp2_shards(strategy: Strategy) -> bool:
    """Whether the runtime wraps the model in FSDP2 under ``strategy``: over two data ranks or more, for ZeRO-2,
    FSDP and HSDP, and for any sharding beside tensor or pipeline parallelism (DDP takes no DTensor parameters and
    no pipeline stage). One process (and tensor or pipeline parallelism without data parallelism) runs unwrapped."""
    if strategy.data == 1:
        return False
    return ZERO_STAGE[strategy.sharding] >= 2 or strategy.tensor > 1 or strategy.pipeline > 1


def residual_bytes(strategy: Strategy, shape: TransformerShape | None = None) -> int:
    """Bytes of one value of the residual stream (a block's input and output): 4 in an fp32 step; in a 16-bit
    one the width ``shape`` fixes for another framework, else the runtime's: 2 under FSDP2's mixed precision, 4
    under autocast alone."""
    if strategy.precision == "fp32":
        return 4
    if shape is not None and shape.residual_bytes is not None:
        return shape.residual_bytes
    if shape is not None and shape.norm == "layernorm" and not shape.final_norm:
        return 4  # a post-norm block (BERT's) ends in a LayerNorm, whose output CUDA's autocast makes fp32
    return 2 if fsdp2_shards(strategy) else AUTOCAST_STREAM_BYTES


def norm_input_bytes(strategy: Strategy, shape: TransformerShape) -> int:
    """Bytes per value a block's norm saves of the residual stream (Korthikanti's "norm input"): at least an
    activation value; where a framework fixes the stream (``shape.residual_bytes``), its width, as a fused norm
    saves it; under the runtime a LayerNorm's fp32 copy (CUDA's autocast runs ``layer_norm`` in fp32), an RMSNorm's
    the stream's width."""
    value = activation_value_bytes(strategy)
    if shape.residual_bytes is None and shape.norm == "layernorm":
        return 4
    return max(value, residual_bytes(strategy, shape))


def block_input_bytes(profile: WorkloadProfile, block: LayerProfile, strategy: Strategy) -> float:
    """Bytes per sample of a block's input (and so of its output), whole: what full checkpointing keeps of it and
    what a pipeline stage sends and receives. A transformer's is its residual stream, s x h values of
    ``residual_bytes``; another model's what the tracer measured under autocast alone (under FSDP2 it may be
    narrower: the plan errs high)."""
    shape = profile.transformer
    if shape is None or not block.is_block:
        return block.input_bytes_per_sample.get(activation_key(strategy), 0.0)
    return float(residual_bytes(strategy, shape) * profile.tokens_per_sample * shape.hidden)


def check_residual_bytes(width: int | None) -> None:
    """A residual stream's width a user fixes: None (the runtime's), 2 or 4 bytes a value."""
    if width is None:
        return
    check_integral("residual_bytes", width)
    if width not in (2, 4):
        raise refuse("{residual_bytes} is 2 (a bf16 or fp16 stream) or 4 (fp32), not {value}", value=width)


def with_residual_bytes(profile: WorkloadProfile, width: int | None) -> WorkloadProfile:
    """``profile`` planned for a framework that keeps its residual stream ``width`` bytes wide under every
    strategy (Megatron-LM's bf16: 2), instead of as redline's runtime keeps it; None leaves it to the runtime.
    Only a transformer has a residual stream the planner knows the shape of."""
    check_residual_bytes(width)
    if width is None:
        return profile
    if profile.transformer is None:
        raise refuse("{residual_bytes}: {model} is not a transformer (no residual stream to set)", model=profile.name)
    return replace(profile, transformer=profile.transformer.replace(residual_bytes=width))
