"""The analytic transformer formulas reproduce published numbers: exact parameter counts of the presets and of
Hugging Face config.json files, Korthikanti et al.'s activation memory (Table 2), and Megatron-LM's and
Narayanan et al.'s FLOP formulas. Every expected number names its source; none is read from disk at run time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from redline.errors import BadInput
from redline.workload.hf import read_config, shape_from_config
from redline.workload.presets import TRANSFORMER_PRESETS, preset_profile
from redline.workload.profile import TransformerShape
from redline.workload.transformer import (
    block_activation_bytes,
    block_forward_flops,
    block_input_bytes,
    count_params,
    forward_flops,
    largest_module_params,
    logits_activation_bytes,
    logits_forward_flops,
    narayanan_step_flops,
    transformer_profile,
)

EXACT = 1e-9


def gpt(hidden: int, layers: int, heads: int, *, vocab: int = 51200, seq_len: int = 2048) -> TransformerShape:
    """A Megatron GPT as Narayanan et al. 2021 and Korthikanti et al. 2022 size them: f = 4h, multi-head
    attention, learned positions, tied head, biases, dropout on."""
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=4 * hidden,
        vocab=vocab,
        seq_len=seq_len,
        position_embeddings=seq_len,
    )


# ------------------------------------------------------------------------------------ parameter counts

# Total parameters as Hugging Face's model.num_parameters() reports them (GPT2LMHeadModel, LlamaForCausalLM,
# BertModel, T5ForConditionalGeneration), the figures on the model cards and in the papers' tables.
PUBLISHED_PARAMS = [
    ("gpt2", 124_439_808),
    ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200),
    ("llama-2-7b", 6_738_415_616),
    ("llama-2-13b", 13_015_864_320),
    ("llama-2-70b", 68_976_648_192),
    ("llama-3-8b", 8_030_261_248),
    ("llama-3-70b", 70_553_706_496),
    ("bert-base", 108_310_272),  # bert-base-cased
    ("bert-large", 333_579_264),  # bert-large-cased
    ("t5-3b", 2_851_598_336),  # "2851M" in DeepSpeed docs/code-docs/source/memory.rst
]


@pytest.mark.parametrize(("preset", "expected"), PUBLISHED_PARAMS, ids=[name for name, _ in PUBLISHED_PARAMS])
def test_preset_param_count_is_exact(preset: str, expected: int) -> None:
    assert count_params(TRANSFORMER_PRESETS[preset]) == expected
    profile = preset_profile(preset)
    assert profile.params_total == expected
    assert sum(layer.params for layer in profile.layers) == expected


def test_t5_large_param_count_and_largest_layer() -> None:
    # DeepSpeed memory.rst: t5-large "737.67M total params, 32.90M largest layer params"
    shape = TransformerShape(
        layers=48,
        decoder_layers=24,
        hidden=1024,
        heads=16,
        ffn_hidden=4096,
        vocab=32128,
        seq_len=512,
        norm="rmsnorm",
        bias=False,
        extra_params=2 * 32 * 16,
    )
    assert count_params(shape) == 737_668_096
    assert largest_module_params(shape) == 32128 * 1024 == 32_899_072


# Narayanan et al. 2021 Table 1 (Megatron GPT, V = 51200, s = 2048): (heads, hidden, layers) -> billions, as
# the paper rounds them
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


@pytest.mark.parametrize(
    ("billions", "heads", "hidden", "layers"), NARAYANAN_TABLE1, ids=[f"{row[0]}B" for row in NARAYANAN_TABLE1]
)
def test_megatron_gpt_sizes_round_to_narayanan_table1(billions: float, heads: int, hidden: int, layers: int) -> None:
    assert round(count_params(gpt(hidden, layers, heads)) / 1e9, 1) == billions


# ------------------------------------------------------------------------------ Hugging Face config.json

# Published config.json files (huggingface.co/<repo>/blob/main/config.json), keys the layout ignores included
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257,
    },
    "gpt2-xl": {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 1600,
        "n_head": 25,
        "n_layer": 48,
        "n_positions": 1024,
        "output_past": True,
        "resid_pdrop": 0.1,
        "vocab_size": 50257,
    },
    "llama-2-7b": {  # meta-llama/Llama-2-7b-hf
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "llama-2-70b": {  # meta-llama/Llama-2-70b-hf: grouped-query attention, 8 KV heads
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 8192,
        "initializer_range": 0.02,
        "intermediate_size": 28672,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.32.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "llama-3-8b": {  # meta-llama/Meta-Llama-3-8B
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "bert-base": {  # bert-base-cased
        "architectures": ["BertForMaskedLM"],
        "attention_probs_dropout_prob": 0.1,
        "gradient_checkpointing": False,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 768,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 512,
        "model_type": "bert",
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "transformers_version": "4.6.0.dev0",
        "type_vocab_size": 2,
        "use_cache": True,
        "vocab_size": 28996,
    },
    "t5-3b": {  # t5-3b (google-t5/t5-3b): no num_decoder_layers (= num_layers), ReLU MLP
        "architectures": ["T5WithLMHeadModel"],
        "d_ff": 16384,
        "d_kv": 128,
        "d_model": 1024,
        "decoder_start_token_id": 0,
        "dropout_rate": 0.1,
        "eos_token_id": 1,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "layer_norm_epsilon": 1e-06,
        "model_type": "t5",
        "n_positions": 512,
        "num_heads": 32,
        "num_layers": 24,
        "output_past": True,
        "pad_token_id": 0,
        "relative_attention_num_buckets": 32,
        "vocab_size": 32128,
    },
}


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


@pytest.mark.parametrize("preset", list(HF_CONFIGS), ids=list(HF_CONFIGS))
def test_hf_config_matches_preset(tmp_path: Path, preset: str) -> None:
    write_config(tmp_path, HF_CONFIGS[preset])
    shape = shape_from_config(read_config(tmp_path), origin=str(tmp_path))  # a model directory
    expected = dict(PUBLISHED_PARAMS)[preset]
    assert count_params(shape) == expected
    reference = TRANSFORMER_PRESETS[preset]
    assert shape.seq_len == reference.seq_len
    assert forward_flops(shape) == forward_flops(reference)
    assert largest_module_params(shape) == largest_module_params(reference)


def test_hf_config_file_path_and_seq_len_override(tmp_path: Path) -> None:
    path = write_config(tmp_path, HF_CONFIGS["llama-3-8b"])
    shape = shape_from_config(read_config(path), seq_len=2048)
    assert shape.seq_len == 2048
    assert shape.groups == 8
    assert count_params(shape) == 8_030_261_248


# each architecture's dropout probabilities as its config.json names them
DROPOUTS = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "bert-base": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "t5-3b": ("dropout_rate",),
    "llama-2-7b": ("attention_dropout",),
}


@pytest.mark.parametrize("preset", list(DROPOUTS), ids=list(DROPOUTS))
def test_a_config_without_dropout_saves_no_dropout_masks(preset: str) -> None:
    """A config that sets its dropout probabilities to 0 (as one written for a run without dropout does) keeps no
    mask; one that leaves them out has the architecture's default (0.1, but Llama's 0); one on is dropout."""
    keys = DROPOUTS[preset]
    config = {k: v for k, v in HF_CONFIGS[preset].items() if k not in keys}
    default = preset != "llama-2-7b"
    assert shape_from_config(config).dropout is default
    assert shape_from_config(config | dict.fromkeys(keys, 0.0)).dropout is False
    assert shape_from_config(config | dict.fromkeys(keys, 0.0) | {keys[-1]: 0.1}).dropout is True
    off = transformer_profile(shape_from_config(config | dict.fromkeys(keys, 0.0)), name=preset, source="test")
    on = transformer_profile(shape_from_config(config | dict.fromkeys(keys, 0.1)), name=preset, source="test")
    assert off.layers[1].activation_bytes_per_sample["16bit"] < on.layers[1].activation_bytes_per_sample["16bit"]


def _drop(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


BAD_CONFIGS = [
    pytest.param('{"model_type": "gpt2", "n_embd": 768,', "not valid JSON", id="truncated-json"),
    pytest.param("[1, 2, 3]", "no 'model_type'", id="json-list"),
    pytest.param(json.dumps(_drop(HF_CONFIGS["gpt2"], "model_type")), "no 'model_type'", id="no-model-type"),
    pytest.param(
        json.dumps(HF_CONFIGS["gpt2"] | {"model_type": "mamba"}),
        "no built-in layout for model_type 'mamba'",
        id="unknown",
    ),
    pytest.param(json.dumps(_drop(HF_CONFIGS["gpt2"], "n_layer")), "lacks 'n_layer'", id="gpt2-no-n_layer"),
    pytest.param(
        json.dumps(_drop(HF_CONFIGS["llama-2-7b"], "hidden_size")), "lacks 'hidden_size'", id="llama-no-hidden"
    ),
    pytest.param(json.dumps(_drop(HF_CONFIGS["bert-base"], "vocab_size")), "lacks 'vocab_size'", id="bert-no-vocab"),
    pytest.param(json.dumps(_drop(HF_CONFIGS["t5-3b"], "d_kv")), "lacks 'd_kv'", id="t5-no-d_kv"),
    pytest.param(json.dumps(HF_CONFIGS["gpt2"] | {"n_layer": "twelve"}), "malformed gpt2 config", id="non-integer"),
    pytest.param(json.dumps(HF_CONFIGS["gpt2"] | {"n_layer": 0}), "malformed gpt2 config", id="zero-layers"),
    pytest.param(
        json.dumps(HF_CONFIGS["llama-2-7b"] | {"num_key_value_heads": 5}), "malformed llama config", id="kv-not-divisor"
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_config_is_one_line_bad_input(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(BadInput) as caught:
        shape_from_config(read_config(path), origin=str(path))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_config_file_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no such config file") as caught:
        read_config(tmp_path)  # a directory without config.json
    assert "\n" not in str(caught.value)


def test_shape_from_config_without_model_type_is_bad_input() -> None:
    with pytest.raises(BadInput):
        shape_from_config(_drop(HF_CONFIGS["gpt2"], "model_type"))


# ------------------------------------------------------------------------ activations (Korthikanti Table 2)

# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2 and
# Table 3: (name, s, h, a, t); per layer and per sequence (b = 1), 16-bit activations, 1-byte dropout masks
KORTHIKANTI_SHAPES = [
    ("gpt3-175b", 2048, 12288, 96, 8),
    ("mt-nlg-530b", 2048, 20480, 128, 8),
    ("1t", 2048, 25600, 160, 8),
    ("22b", 2048, 6144, 64, 8),
    ("small-t2", 1024, 1024, 16, 2),
]


def _korthikanti_expected(variant: str, s: int, h: int, a: int, t: int) -> float:
    sbh = s * h  # b = 1
    return {
        "no-parallelism": sbh * (34 + 5 * a * s / h),
        "tensor-parallel": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp-sequence-parallel": sbh / t * (34 + 5 * a * s / h),
        "tp-selective": sbh * (10 + 24 / t),
        "tp-sp-selective": 34 * sbh / t,
    }[variant]


_VARIANT_FLAGS = {
    "no-parallelism": (False, False, False),  # (use t, sequence parallel, selective recompute)
    "tensor-parallel": (True, False, False),
    "tp-sequence-parallel": (True, True, False),
    "tp-selective": (True, False, True),
    "tp-sp-selective": (True, True, True),
}


@pytest.mark.parametrize("variant", list(_VARIANT_FLAGS))
@pytest.mark.parametrize(
    ("s", "h", "a", "t"), [row[1:] for row in KORTHIKANTI_SHAPES], ids=[r[0] for r in KORTHIKANTI_SHAPES]
)
def test_block_activation_bytes_matches_korthikanti_table2(variant: str, s: int, h: int, a: int, t: int) -> None:
    use_t, sp, selective = _VARIANT_FLAGS[variant]
    tp = t if use_t else 1
    got = block_activation_bytes(
        gpt(h, 1, a, seq_len=s),
        s,
        tensor_parallel=tp,
        sequence_parallel=sp,
        flash_attention=False,
        selective_recompute=selective,
    )
    assert got == pytest.approx(_korthikanti_expected(variant, s, h, a, tp), rel=EXACT)


def test_full_recompute_keeps_2sbh() -> None:
    # Korthikanti Table 2, "full recompute": 2sbh per layer
    assert block_input_bytes(gpt(12288, 96, 96), 2048, bytes_per_value=2) == 2 * 2048 * 12288


@pytest.mark.parametrize(("ffn_ratio", "t"), [(3, 1), (3, 4), (8, 8)], ids=["f3h-t1", "f3h-t4", "f8h-t8"])
def test_megatron_generalised_selective_sp_term(ffn_ratio: int, t: int) -> None:
    # NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py: sbh(18 + 4f/h)/t per layer with SP and
    # selective recompute (ungated MLP, multi-head attention)
    s, h = 2048, 4096
    shape = gpt(h, 1, 32, seq_len=s).replace(ffn_hidden=ffn_ratio * h)
    got = block_activation_bytes(
        shape, s, tensor_parallel=t, sequence_parallel=True, flash_attention=False, selective_recompute=True
    )
    assert got == pytest.approx(s * h * (18 + 4 * ffn_ratio) / t, rel=EXACT)


def test_a_fused_swiglu_keeps_one_f_wide_tensor_fewer() -> None:
    # Megatron's fused SwiGLU saves its input (gate and up) and recomputes act(gate); the down projection still
    # saves the product: 3 f-wide tensors where eager PyTorch keeps 4 (gate, up, act(gate), product)
    s, t = 2048, 8
    llama = TransformerShape(layers=1, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq_len=s, gated_mlp=True)
    eager = block_activation_bytes(llama, s, tensor_parallel=t, sequence_parallel=True)
    fused = block_activation_bytes(
        llama.replace(fused_gated_activation=True), s, tensor_parallel=t, sequence_parallel=True
    )
    assert eager - fused == 2 * s * 11008 / t


def test_a_bf16_residual_stream_halves_what_full_checkpointing_keeps() -> None:
    shape = gpt(1024, 2, 16, seq_len=512)
    autocast = transformer_profile(shape, name="a", source="test").blocks[0]
    megatron = transformer_profile(shape.replace(residual_bytes=2), name="m", source="test").blocks[0]
    assert autocast.input_bytes_per_sample["16bit"] == 4 * 512 * 1024
    assert megatron.input_bytes_per_sample["16bit"] == 2 * 512 * 1024
    assert megatron.input_bytes_per_sample["fp32"] == 4 * 512 * 1024  # an fp32 step's residual stays fp32
    # each block's two norms save the residual stream: 2 x s x h x 2 bytes fewer
    assert (
        autocast.activation_bytes_per_sample["16bit"] - megatron.activation_bytes_per_sample["16bit"] == 4 * 512 * 1024
    )
    with pytest.raises(ValueError, match="residual_bytes"):
        shape.replace(residual_bytes=3)


@pytest.mark.parametrize("t", [1, 8])
def test_logits_activation_bytes_is_megatron_last_stage_term(t: int) -> None:
    # theoretical_memory_usage.py: 4sbh(1 + V/h), divided by t
    s, h, v = 2048, 12288, 51200
    assert logits_activation_bytes(gpt(h, 96, 96), s, tensor_parallel=t) == pytest.approx(
        4 * s * h * (1 + v / h) / t, rel=EXACT
    )


# ------------------------------------------------------------------------------------------------ FLOPs


def megatron_flops(shape: TransformerShape, batch: int) -> float:
    """NVIDIA/Megatron-LM megatron/training/training.py ``num_floating_point_operations`` (dense, top-k 1):
    12 B s L h^2 [(1 + G/a + s/h)(q/h) + (f/h) g + V/(2Lh)], g = 3/2 for a gated MLP."""
    s, n_layers, h = shape.seq_len, shape.layers, shape.hidden
    g = 1.5 if shape.gated_mlp else 1.0
    attention = (1 + shape.groups / shape.heads + s / h) * (shape.query_width / h)
    mlp = shape.ffn_hidden / h * g
    logit = shape.vocab / (2 * n_layers * h)
    return 12 * batch * s * n_layers * h * h * (attention + mlp + logit)


FLOP_SHAPES = [
    ("gpt2", TRANSFORMER_PRESETS["gpt2"]),
    ("gpt2-xl", TRANSFORMER_PRESETS["gpt2-xl"]),
    ("gpt3-175b", gpt(12288, 96, 96)),
    ("mt-nlg-530b", gpt(20480, 105, 128)),
    ("llama-2-7b", TRANSFORMER_PRESETS["llama-2-7b"]),  # gated
    ("llama-2-70b", TRANSFORMER_PRESETS["llama-2-70b"]),  # gated, GQA
    ("llama-3-8b", TRANSFORMER_PRESETS["llama-3-8b"]),
]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", [s for _, s in FLOP_SHAPES], ids=[n for n, _ in FLOP_SHAPES])
def test_training_flops_match_megatron_formula(shape: TransformerShape, batch: int) -> None:
    # matmuls only on both sides (biases, norms, softmax are in neither), so the match is exact
    assert 3 * batch * forward_flops(shape) == pytest.approx(megatron_flops(shape, batch), rel=1e-12)


def test_profile_training_flops_are_megatron_formula() -> None:
    profile = preset_profile("llama-2-7b")
    assert profile.training_flops_per_sample == pytest.approx(
        megatron_flops(TRANSFORMER_PRESETS["llama-2-7b"], 1), rel=1e-12
    )
    assert profile.forward_flops_per_sample == sum(layer.forward_flops_per_sample for layer in profile.layers)


NARAYANAN_SHAPES = [(n, s) for n, s in FLOP_SHAPES if not s.gated_mlp]


@pytest.mark.parametrize("batch", [1, 1536])
@pytest.mark.parametrize("shape", [s for _, s in NARAYANAN_SHAPES], ids=[n for n, _ in NARAYANAN_SHAPES])
def test_narayanan_step_flops_is_three_forwards(shape: TransformerShape, batch: int) -> None:
    # Narayanan et al. 2021 App. A: 72 B s L h^2 (1 + s/6h + V/12Lh) = forward + 2x backward, exactly
    got = narayanan_step_flops(batch, shape.seq_len, shape.layers, shape.hidden, shape.vocab)
    assert got == pytest.approx(3 * batch * forward_flops(shape), rel=1e-12)


@pytest.mark.parametrize("batch", [1, 1536])
@pytest.mark.parametrize("shape", [s for _, s in NARAYANAN_SHAPES], ids=[n for n, _ in NARAYANAN_SHAPES])
def test_narayanan_recompute_is_four_block_forwards_three_logit(shape: TransformerShape, batch: int) -> None:
    # 96 B s L h^2 (1 + s/6h + V/16Lh): full recompute repeats the blocks' forward (4x) but not the logits (3x)
    s = shape.seq_len
    expected = batch * (4 * shape.layers * block_forward_flops(shape, s) + 3 * logits_forward_flops(shape, s))
    got = narayanan_step_flops(batch, s, shape.layers, shape.hidden, shape.vocab, recompute=True)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got / narayanan_step_flops(batch, s, shape.layers, shape.hidden, shape.vocab) < 4 / 3
