"""Built-in model presets: the shapes of well-known models, as their published configs give them.

Transformer presets are analytic (exact parameter counts of the Hugging Face implementations; the tests
check them against the published totals). ResNet-50 and ViT-B/16 are traced from redline's own module
definitions (``workload.zoo``), which needs PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from redline.errors import BadInput
from redline.workload.profile import TransformerShape, WorkloadProfile


def _gpt2(hidden: int, layers: int, heads: int) -> TransformerShape:
    # GPT-2 (Radford et al. 2019; Hugging Face config.json): learned positions, tied head, dropout 0.1
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=4 * hidden,
        vocab=50257,
        seq_len=1024,
        position_embeddings=1024,
    )


def _llama(
    hidden: int,
    layers: int,
    heads: int,
    ffn: int,
    *,
    kv_heads: int | None = None,
    vocab: int = 32000,
    seq_len: int = 4096,
) -> TransformerShape:
    # Llama 2 / 3 (Touvron et al. 2023; Meta config.json): SwiGLU, RMSNorm, RoPE, no biases, untied head
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=ffn,
        vocab=vocab,
        seq_len=seq_len,
        kv_heads=kv_heads,
        gated_mlp=True,
        tied_embeddings=False,
        norm="rmsnorm",
        bias=False,
        dropout=False,
    )


def _bert(hidden: int, layers: int, heads: int) -> TransformerShape:
    # BERT cased (Devlin et al. 2019), as BertModel: 512 positions, 2 token types, embedding LayerNorm and
    # the pooler (h x h + h) outside the blocks; no LM head
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=4 * hidden,
        vocab=28996,
        seq_len=512,
        position_embeddings=512,
        lm_head=False,
        final_norm=False,
        extra_params=2 * hidden + 2 * hidden + hidden * hidden + hidden,
    )


TRANSFORMER_PRESETS: dict[str, TransformerShape] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama-2-7b": _llama(4096, 32, 32, 11008),
    "llama-2-13b": _llama(5120, 40, 40, 13824),
    "llama-2-70b": _llama(8192, 80, 64, 28672, kv_heads=8),
    "llama-3-8b": _llama(4096, 32, 32, 14336, kv_heads=8, vocab=128256, seq_len=8192),
    "llama-3-70b": _llama(8192, 80, 64, 28672, kv_heads=8, vocab=128256, seq_len=8192),
    "bert-base": _bert(768, 12, 12),
    "bert-large": _bert(1024, 24, 16),
    # T5 v1.0 3B (Raffel et al. 2020): 24 encoder + 24 decoder blocks, 32 heads of 128 on d_model 1024,
    # ReLU MLP of 16384, no biases, tied head, relative position buckets (32 x 32 heads, twice)
    "t5-3b": TransformerShape(
        layers=48,
        decoder_layers=24,
        hidden=1024,
        heads=32,
        head_dim=128,
        ffn_hidden=16384,
        vocab=32128,
        seq_len=512,
        norm="rmsnorm",
        bias=False,
        extra_params=2 * 32 * 32,
    ),
}


@dataclass(frozen=True)
class TracedPreset:
    """A preset traced from a module redline defines itself."""

    build: Callable[[], object]
    input_shape: tuple[int, ...]


def traced_presets() -> dict[str, TracedPreset]:
    from redline.workload import zoo

    return {
        "resnet50": TracedPreset(zoo.resnet50, (3, 224, 224)),
        "vit-b-16": TracedPreset(zoo.vit_b_16, (3, 224, 224)),
    }


TRACED_PRESET_NAMES: tuple[str, ...] = ("resnet50", "vit-b-16")
PRESET_NAMES: tuple[str, ...] = (*TRANSFORMER_PRESETS, *TRACED_PRESET_NAMES)


def preset_profile(name: str, seq_len: int | None = None) -> WorkloadProfile:
    """The profile of a preset, at ``seq_len`` when given (language models only)."""
    key = name.strip().lower()
    if key in TRANSFORMER_PRESETS:
        from redline.workload.transformer import transformer_profile

        shape = TRANSFORMER_PRESETS[key]
        if seq_len is not None:
            shape = shape.replace(seq_len=seq_len)
        return transformer_profile(shape, name=key, source=f"preset {key}")
    if key in TRACED_PRESET_NAMES:
        from redline.capability import require_torch
        from redline.workload.trace import trace_module

        require_torch(f"the {key} preset is traced from a PyTorch module")
        preset = traced_presets()[key]
        return trace_module(preset.build, preset.input_shape, name=key, source=f"preset {key}", sample_unit="image")
    raise BadInput(f"unknown model preset '{name}'; known: {', '.join(PRESET_NAMES)}")
