"""Hugging Face ``config.json`` files: the model's shape without its weights.

Known architectures map onto a ``TransformerShape`` directly (no extra packages): the transformer formulas
read it where asked (``--analytic``), and it checks a known config before it is traced. A config is otherwise
read by building its real module through ``transformers`` (the ``hf`` extra) on fake tensors and tracing it,
which covers any architecture the library knows; ``workload.load.config_profile`` picks the reading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redline.errors import BadInput
from redline.files import read_user_file
from redline.workload.profile import TransformerShape

# past this many positions (Llama 3.1 declares 131072) the default training length is capped; --seq-len wins
DEFAULT_SEQ_CAP = 8192

# the dropout probabilities transformers' configs take where a config.json leaves them out (GPT2Config's resid_pdrop,
# embd_pdrop and attn_pdrop; BertConfig's hidden_dropout_prob and attention_probs_dropout_prob; T5Config's
# dropout_rate); Llama-like configs default attention_dropout to 0
GPT2_DROPOUT = BERT_DROPOUT = T5_DROPOUT = 0.1

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
    layout = _LAYOUTS.get(model_type)
    if layout is None:
        raise BadInput(
            f"{origin}: no built-in layout for model_type '{model_type}' (known: gpt2, {', '.join(LLAMA_LIKE)}, "
            "bert, t5); transformers traces it: the hf extra: pip install transformers"
        )
    try:
        return layout(_Fields(config, origin, model_type, seq_len))
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{origin}: malformed {model_type} config: {exc}") from None


@dataclass(frozen=True)
class _Fields:
    """A config as the layouts read it: a required field that is missing is BadInput naming the file."""

    config: dict[str, Any]
    origin: str
    model_type: str
    seq_len: int | None  # the training length asked for, if any

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of ``keys`` the config sets; ``default`` where it sets none, BadInput where there is none."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.config[key]
        if default is None:
            raise BadInput(f"{self.origin}: model_type '{self.model_type}' config lacks '{keys[0]}'")
        return default

    def length(self, declared: int) -> int:
        """The training length: the one asked for, else the declared positions up to ``DEFAULT_SEQ_CAP``."""
        return self.seq_len or min(int(declared), DEFAULT_SEQ_CAP)

    def dropout(self, *keys: str, default: float) -> bool:
        """Whether any of the dropout probabilities ``keys`` is above 0 (``default``, the architecture's own, where
        the config leaves one out): a dropout of 0 keeps no mask (PyTorch returns its input), one above keeps a
        mask. The shape has one switch for every dropout of the model, so any one on turns them all on."""
        values = (self.config.get(key) for key in keys)
        return any(float(default if value is None else value) > 0 for value in values)


def _gpt2(fields: _Fields) -> TransformerShape:
    config = fields.config
    hidden = int(fields.get("n_embd"))
    return TransformerShape(
        layers=int(fields.get("n_layer")),
        hidden=hidden,
        heads=int(fields.get("n_head")),
        ffn_hidden=int(config.get("n_inner") or 4 * hidden),
        vocab=int(fields.get("vocab_size")),
        seq_len=fields.length(fields.get("n_positions", default=1024)),
        position_embeddings=int(fields.get("n_positions", default=1024)),
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        dropout=fields.dropout("resid_pdrop", "embd_pdrop", "attn_pdrop", default=GPT2_DROPOUT),
    )


def _llama(fields: _Fields) -> TransformerShape:
    config = fields.config
    return TransformerShape(
        layers=int(fields.get("num_hidden_layers")),
        hidden=int(fields.get("hidden_size")),
        heads=int(fields.get("num_attention_heads")),
        kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"),
        ffn_hidden=int(fields.get("intermediate_size")),
        vocab=int(fields.get("vocab_size")),
        seq_len=fields.length(fields.get("max_position_embeddings", default=4096)),
        gated_mlp=True,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm="rmsnorm",
        bias=bool(config.get("attention_bias", False)),
        dropout=fields.dropout("attention_dropout", default=0.0),
    )


def _bert(fields: _Fields) -> TransformerShape:
    hidden = int(fields.get("hidden_size"))
    return TransformerShape(
        layers=int(fields.get("num_hidden_layers")),
        hidden=hidden,
        heads=int(fields.get("num_attention_heads")),
        ffn_hidden=int(fields.get("intermediate_size")),
        vocab=int(fields.get("vocab_size")),
        seq_len=fields.length(fields.get("max_position_embeddings", default=512)),
        position_embeddings=int(fields.get("max_position_embeddings", default=512)),
        lm_head=False,
        final_norm=False,
        dropout=fields.dropout("hidden_dropout_prob", "attention_probs_dropout_prob", default=BERT_DROPOUT),
        extra_params=int(fields.get("type_vocab_size", default=2)) * hidden + 2 * hidden + hidden * hidden + hidden,
    )


def _t5(fields: _Fields) -> TransformerShape:
    """An encoder-decoder: its decoder layers count among the layers."""
    config = fields.config
    layers = int(fields.get("num_layers"))
    heads = int(fields.get("num_heads"))
    gated = str(config.get("feed_forward_proj", "relu")).startswith("gated")
    return TransformerShape(
        layers=layers + int(config.get("num_decoder_layers") or layers),
        decoder_layers=int(config.get("num_decoder_layers") or layers),
        hidden=int(fields.get("d_model")),
        heads=heads,
        head_dim=int(fields.get("d_kv")),
        ffn_hidden=int(fields.get("d_ff")),
        vocab=int(fields.get("vocab_size")),
        seq_len=fields.seq_len or 512,
        norm="rmsnorm",
        bias=False,
        gated_mlp=gated,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        dropout=fields.dropout("dropout_rate", default=T5_DROPOUT),
        extra_params=2 * int(config.get("relative_attention_num_buckets", 32)) * heads,
    )


_LAYOUTS: dict[str, Callable[[_Fields], TransformerShape]] = {
    "gpt2": _gpt2,
    **dict.fromkeys(LLAMA_LIKE, _llama),
    "bert": _bert,
    "t5": _t5,
}
