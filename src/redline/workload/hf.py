"""Hugging Face ``config.json`` files: the model's shape without its weights.

Known architectures map onto a ``TransformerShape`` directly (no extra packages). With ``transformers``
installed the real module is also built from the config on fake tensors and traced, which covers any
architecture the library knows and gives exact counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from redline.errors import BadInput, read_user_file
from redline.workload.profile import TransformerShape

# past this many positions (Llama 3.1 declares 131072) the default training length is capped; --seq-len wins
DEFAULT_SEQ_CAP = 8192

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
KNOWN_MODEL_TYPES = ("gpt2", *LLAMA_LIKE, "bert", "t5")


def read_config(path: Path) -> dict[str, Any]:
    """The config.json at ``path`` (a file or a model directory); BadInput with the reason otherwise."""
    if path.is_dir():
        path = path / "config.json"
    text = read_user_file(path, "config file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise BadInput(f"{path} is not a Hugging Face model config (no 'model_type')")
    return data


def shape_from_config(config: dict[str, Any], seq_len: int | None = None, origin: str = "config") -> TransformerShape:
    """A TransformerShape for the model types whose layout we know; BadInput for the others."""
    if not config.get("model_type"):
        raise BadInput(f"{origin} is not a Hugging Face model config (no 'model_type')")
    model_type = str(config["model_type"])

    def get(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if config.get(key) is not None:
                return config[key]
        if default is None:
            raise BadInput(f"{origin}: model_type '{model_type}' config lacks '{keys[0]}'")
        return default

    def length(declared: int) -> int:
        return seq_len or min(int(declared), DEFAULT_SEQ_CAP)

    try:
        if model_type == "gpt2":
            hidden = int(get("n_embd"))
            return TransformerShape(
                layers=int(get("n_layer")),
                hidden=hidden,
                heads=int(get("n_head")),
                ffn_hidden=int(config.get("n_inner") or 4 * hidden),
                vocab=int(get("vocab_size")),
                seq_len=length(get("n_positions", default=1024)),
                position_embeddings=int(get("n_positions", default=1024)),
                tied_embeddings=bool(config.get("tie_word_embeddings", True)),
            )
        if model_type in LLAMA_LIKE:
            return TransformerShape(
                layers=int(get("num_hidden_layers")),
                hidden=int(get("hidden_size")),
                heads=int(get("num_attention_heads")),
                kv_heads=config.get("num_key_value_heads"),
                head_dim=config.get("head_dim"),
                ffn_hidden=int(get("intermediate_size")),
                vocab=int(get("vocab_size")),
                seq_len=length(get("max_position_embeddings", default=4096)),
                gated_mlp=True,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                norm="rmsnorm",
                bias=bool(config.get("attention_bias", False)),
                dropout=float(config.get("attention_dropout", 0)) > 0,
            )
        if model_type == "bert":
            hidden = int(get("hidden_size"))
            return TransformerShape(
                layers=int(get("num_hidden_layers")),
                hidden=hidden,
                heads=int(get("num_attention_heads")),
                ffn_hidden=int(get("intermediate_size")),
                vocab=int(get("vocab_size")),
                seq_len=length(get("max_position_embeddings", default=512)),
                position_embeddings=int(get("max_position_embeddings", default=512)),
                lm_head=False,
                final_norm=False,
                extra_params=int(get("type_vocab_size", default=2)) * hidden + 2 * hidden + hidden * hidden + hidden,
            )
        if model_type == "t5":
            layers = int(get("num_layers"))
            heads = int(get("num_heads"))
            gated = str(config.get("feed_forward_proj", "relu")).startswith("gated")
            return TransformerShape(
                layers=layers + int(config.get("num_decoder_layers") or layers),
                decoder_layers=int(config.get("num_decoder_layers") or layers),
                hidden=int(get("d_model")),
                heads=heads,
                head_dim=int(get("d_kv")),
                ffn_hidden=int(get("d_ff")),
                vocab=int(get("vocab_size")),
                seq_len=seq_len or 512,
                norm="rmsnorm",
                bias=False,
                gated_mlp=gated,
                tied_embeddings=bool(config.get("tie_word_embeddings", True)),
                extra_params=2 * int(config.get("relative_attention_num_buckets", 32)) * heads,
            )
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{origin}: malformed {model_type} config: {exc}") from None
    raise BadInput(
        f"{origin}: no built-in layout for model_type '{model_type}' (known: gpt2, {', '.join(LLAMA_LIKE)}, bert, t5); "
        "install transformers to trace it"
    )
