"""Selective activation checkpointing in the planner: Korthikanti et al. 2022's for an analytic transformer (all
but the attention core kept), what the tracer measured under workload.selective's policy for a traced model, and
the recomputation it costs."""

from __future__ import annotations

import dataclasses

import pytest

from redline.plan.hardware import parse_hardware
from redline.plan.memory import memory_per_gpu
from redline.plan.steptime import step_time
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile

GPT2 = preset_profile("gpt2")
LLAMA7 = preset_profile("llama-2-7b")
H100X8 = parse_hardware("8xh100-sxm")
CHECKPOINTS = ("none", "selective", "full")


def test_analytic_selective_drops_the_attention_core_korthikanti() -> None:
    """Without flash attention a block saves 5 a s^2 bytes of attention core per sequence (16-bit softmax output
    and its dropout output, a 1-byte mask; Korthikanti et al. 2022, Table 2); selective checkpointing keeps all
    the rest: sbh(34 + 5as/h) becomes 34 sbh."""
    shape = GPT2.transformer
    a, s, b = shape.heads, shape.seq_len, 2
    none = memory_per_gpu(GPT2, Strategy(micro_batch=b, flash_attention=False), gpus_per_node=8)
    selective = memory_per_gpu(
        GPT2, Strategy(micro_batch=b, flash_attention=False, checkpointing="selective"), gpus_per_node=8
    )
    assert none.activations - selective.activations == pytest.approx(shape.layers * 5 * a * s * s * b)
    # tensor + sequence parallel: the blocks split t ways, 34 sbh / t (Table 2's last row); the layers outside them
    # (the logits the runtime gathers whole on every rank, and at most the embedding's output) are not split
    tp = Strategy(tensor=4, sequence_parallel=True, micro_batch=b, flash_attention=False, checkpointing="selective")
    outside = sum(layer.activation_bytes_per_sample["16bit"] for layer in GPT2.layers if not layer.is_block) * b
    assert memory_per_gpu(GPT2, tp, gpus_per_node=8).activations - outside < (selective.activations - outside) / 3


def test_flash_attention_saves_what_selective_saves() -> None:
    """With flash attention no s x s tensor is kept anyway: selective checkpointing changes little memory."""
    none = memory_per_gpu(LLAMA7, Strategy(micro_batch=2), gpus_per_node=8)
    selective = memory_per_gpu(LLAMA7, Strategy(micro_batch=2, checkpointing="selective"), gpus_per_node=8)
    assert selective.activations == pytest.approx(none.activations, rel=0.01)
    no_flash = memory_per_gpu(LLAMA7, Strategy(micro_batch=2, flash_attention=False), gpus_per_node=8)
    assert no_flash.activations > 2 * none.activations  # s = 4096: the core is most of it


@pytest.mark.parametrize(("profile", "most"), [(GPT2, 0.6), (LLAMA7, 0.3)], ids=["gpt2", "llama-2-7b"])
def test_selective_recomputes_the_attention_core_and_the_memory_bound_half(profile, most: float) -> None:
    """Selective reruns no linear layer: a fraction of full recomputation's cost, the smaller the wider the model
    (GPT-2 small is mostly memory-bound work)."""
    none, selective, full = (
        step_time(profile, Strategy(micro_batch=8, checkpointing=c), H100X8).compute for c in CHECKPOINTS
    )
    assert none < selective < full
    assert (selective - none) < most * (full - none)


def _wide_profile():
    pytest.importorskip("torch")
    from torch import nn

    from redline.workload.trace import trace_module

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x):
            return x + self.down(self.up(x).exp().sin())

    return trace_module(lambda: nn.Sequential(*(Wide() for _ in range(4))), (128, 64), name="wide", source="t")


def test_traced_selective_keeps_the_input_and_the_measured_matmul_outputs() -> None:
    """Measured as full checkpointing is: a block keeps its input (``input_bytes_per_sample``) and, under selective
    checkpointing, what the tracer saw the runtime's policy save; its backward reruns its forward, as under full."""
    profile = _wide_profile()
    plain = Strategy(precision="fp32", micro_batch=16)
    memory = {c: memory_per_gpu(profile, dataclasses.replace(plain, checkpointing=c), 1) for c in CHECKPOINTS}
    blocks = profile.blocks
    kept = sum(b.input_bytes_per_sample["fp32"] + b.selective_bytes_per_sample["fp32"] for b in blocks)
    full_kept = sum(b.input_bytes_per_sample["fp32"] for b in blocks)
    assert memory["selective"].activations - memory["full"].activations == pytest.approx(16 * (kept - full_kept))
    assert memory["full"].activations < memory["selective"].activations < memory["none"].activations
    # without the measurement (an older profile): the block's own saved activations, as without checkpointing
    unmeasured = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(layer, selective_bytes_per_sample={}) for layer in profile.layers)
    )
    selective = dataclasses.replace(plain, checkpointing="selective")
    assert memory_per_gpu(unmeasured, selective, 1).activations == pytest.approx(memory["none"].activations)
