"""The residual stream planned as redline's runtime keeps it: 16-bit under FSDP2's bf16 parameters (ZeRO-2, FSDP,
and any data parallelism beside tensor or pipeline parallelism), fp32 under DDP and ZeRO-1's autocast; fixed by
``--residual-bytes`` only for another framework. (The runtime's own tensors: tests/runtime/test_residual_stream.py.)
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from redline.plan.dtypes import norm_input_bytes, residual_bytes, with_residual_bytes
from redline.plan.hardware import parse_hardware
from redline.plan.memory import memory_per_gpu
from redline.plan.messages import PlanInputError
from redline.plan.strategy import Strategy
from redline.units import GiB
from redline.workload.presets import preset_profile

LLAMA7 = preset_profile("llama-2-7b")
GPT2 = preset_profile("gpt2")
H100X8 = parse_hardware("8xh100-sxm")
# the 7B run: FSDP over 8 x H100, bf16, no checkpointing (here Llama-2-7B at micro-batch 3)
FSDP_7B = Strategy(data=8, sharding="fsdp", precision="bf16", micro_batch=3)


def stream_values(profile) -> int:
    """s x h: the values of one sample's residual stream."""
    return profile.tokens_per_sample * profile.transformer.hidden


@pytest.mark.parametrize(
    ("fields", "width"),
    [
        ({"data": 8, "sharding": "fsdp"}, 2),
        ({"data": 8, "sharding": "zero2"}, 2),
        ({"data": 2, "sharding": "hsdp"}, 2),
        ({"data": 2, "pipeline": 4, "sharding": "zero2"}, 2),
        ({"data": 8, "sharding": "ddp"}, 4),
        ({"data": 8, "sharding": "zero1"}, 4),
        ({"data": 1, "sharding": "fsdp"}, 4),  # one process: the runtime wraps nothing
        ({"data": 1, "tensor": 8}, 4),  # no data ranks for FSDP2 beside tensor parallelism
        ({"data": 8, "sharding": "fsdp", "precision": "fp32"}, 4),
    ],
)
def test_the_streams_width_follows_the_runtimes_sharding(fields: dict, width: int) -> None:
    assert residual_bytes(Strategy(**fields), LLAMA7.transformer) == width


def test_a_post_norm_stream_is_a_layernorms_fp32_output() -> None:
    fsdp = Strategy(data=8, sharding="fsdp")
    assert residual_bytes(fsdp, preset_profile("bert-base").transformer) == 4
    assert residual_bytes(fsdp, GPT2.transformer) == 2  # pre-norm: the stream is a residual add's


def test_fsdp_plans_a_16_bit_stream_and_fits_the_7b_run() -> None:
    fsdp = memory_per_gpu(LLAMA7, FSDP_7B, 8)
    as_before = memory_per_gpu(with_residual_bytes(LLAMA7, 4), FSDP_7B, 8)
    # each block's two RMSNorms save the stream 2 bytes a value narrower, over 32 blocks and 3 samples
    assert as_before.activations - fsdp.activations == 32 * 3 * 2 * 2 * stream_values(LLAMA7)
    assert fsdp.activations / GiB == pytest.approx(58.7, abs=0.05)
    assert as_before.activations / GiB == pytest.approx(64.7, abs=0.05)
    assert fsdp.device_total < H100X8.memory_bytes < as_before.device_total
    # DDP's autocast keeps an fp32 stream, as before
    ddp = Strategy(data=8, sharding="ddp", precision="bf16", micro_batch=3)
    assert memory_per_gpu(LLAMA7, ddp, 8).activations == as_before.activations


def test_full_checkpointing_keeps_each_block_input_in_the_streams_width() -> None:
    checkpointed = Strategy(data=8, sharding="fsdp", micro_batch=1, checkpointing="full")
    kept = memory_per_gpu(LLAMA7, checkpointed, 8).activations
    kept_fp32_stream = memory_per_gpu(with_residual_bytes(LLAMA7, 4), checkpointed, 8).activations
    assert kept_fp32_stream - kept == 32 * 2 * stream_values(LLAMA7)


def test_a_layernorm_saves_an_fp32_copy_of_a_16_bit_stream() -> None:
    # CUDA's autocast runs layer_norm in fp32: GPT-2's norms save 4 bytes a value whatever the stream; its block
    # input, under full checkpointing, is still the 16-bit stream
    fsdp = Strategy(data=8, sharding="fsdp", micro_batch=4)
    assert norm_input_bytes(fsdp, GPT2.transformer) == 4
    assert norm_input_bytes(fsdp, LLAMA7.transformer) == 2
    assert (
        memory_per_gpu(GPT2, fsdp, 8).activations == memory_per_gpu(with_residual_bytes(GPT2, 4), fsdp, 8).activations
    )
    # a framework that fixes a bf16 stream (Megatron-LM's fused norms) saves it at 2 bytes
    assert norm_input_bytes(fsdp, with_residual_bytes(GPT2, 2).transformer) == 2


def test_residual_bytes_is_2_or_4_and_needs_a_transformer() -> None:
    with pytest.raises(PlanInputError, match=r"residual_bytes is 2 .* or 4 .*, not 3"):
        with_residual_bytes(LLAMA7, 3)
    with pytest.raises(PlanInputError, match="not a transformer"):
        with_residual_bytes(preset_profile("resnet50"), 2)
    assert with_residual_bytes(LLAMA7, None) is LLAMA7


FIXED_7B = ("--model", "llama-2-7b", "--hardware", "8xh100-sxm", "--sharding", "fsdp", "--precision", "bf16")
FIXED_7B += ("--checkpointing", "none", "--micro-batch", "3", "--global-batch", "24", "--tp", "1", "--pp", "1")


def test_cli_plans_the_7b_fsdp_run_and_residual_bytes_plans_another_framework() -> None:
    fits = run_cli("plan", *FIXED_7B, "--json")
    assert fits.returncode == 0, fits.stderr
    best = json.loads(fits.stdout)["ranked"][0]
    assert best["label"] == "fsdp dp8 mb3x1 bf16" and best["fits"]
    # planned for a framework whose stream is fp32 under every sharding, it does not fit
    fp32_stream = run_cli("plan", *FIXED_7B, "--residual-bytes", "4")
    assert fp32_stream.returncode == 2
    assert "nothing fits on 8xh100-sxm" in fp32_stream.stderr and "Traceback" not in fp32_stream.stderr
    bad = run_cli("plan", *FIXED_7B, "--residual-bytes", "3")
    assert bad.returncode == 2
    assert bad.stderr == "redline: --residual-bytes is 2 (a bf16 or fp16 stream) or 4 (fp32), not 3\n"
