"""The model to serve, as ``redline plan -m`` takes it, turned into one module with one tensor in and one out.

Every backend (an exported graph, an ONNX session) sees the same thing: ``Served(x) -> y``, where ``x`` is a
batch of images (float) or of token ids (long) and ``y`` is the model's first output (a classifier's logits, a
language model's next-token logits, an encoder's last hidden state). A Hugging Face model's output object, its
KV cache and its keyword arguments stay inside the wrapper, so export and ONNX see a plain function.

SPEC is a preset (``resnet50``, ``vit-b-16``; ``gpt2``, ``bert-base``, ``llama-*`` built from their published
configs with random weights), a Hugging Face ``config.json``, or ``package.module:factory``; ``--weights`` loads
a trained state: a ``torch.save``'d state_dict (or a dict holding one under ``model``/``state_dict``) or a
``redline run`` checkpoint directory (``step-N/``, read with torch.distributed.checkpoint).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from redline.errors import BadInput, one_line
from redline.workload.model_spec import ModelKind, ModelSpec, parse_factory, parse_model_spec
from redline.workload.presets import TRACED_PRESET_NAMES, TRANSFORMER_PRESETS
from redline.workload.profile import TransformerShape

Kind = Literal["classifier", "lm", "encoder", "other"]
DEFAULT_SEQ_LEN = 128
# encoder-only layouts, served as their bare model (the last hidden state); any other model type as a causal LM
ENCODERS = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "mpnet"}
)
MAX_SAMPLE_ELEMENTS = 1 << 28  # one sample's input: a 16k x 16k image of 1 channel, 1 GiB as fp32


@dataclasses.dataclass
class Subject:
    """The model to serve and how to feed it."""

    name: str
    served: Served  # eval mode, fp32, on the CPU; one tensor in, one out
    kind: Kind
    sample_shape: tuple[int, ...]  # one sample's input, without the batch dimension
    input_dtype: torch.dtype  # torch.long for token ids
    vocab: int | None = None  # token ids are drawn below it
    hf_config: Any = None  # a transformers config, for generation
    source: dict[str, Any] = dataclasses.field(default_factory=dict)  # how to rebuild it (saved with an artifact)

    def example(self, batch: int, seed: int = 0) -> torch.Tensor:
        """A batch of inputs, the same for every backend (seeded)."""
        generator = torch.Generator().manual_seed(seed)
        if self.input_dtype == torch.long:
            return torch.randint(0, self.vocab or 2, (batch, *self.sample_shape), generator=generator)
        return torch.randn((batch, *self.sample_shape), generator=generator)


class Served(nn.Module):
    """``inner(x)``'s first tensor: the logits or hidden states of a Hugging Face output, a module's output."""

    def __init__(self, inner: nn.Module, hugging_face: bool = False, causal: bool = False) -> None:
        super().__init__()
        self.inner: nn.Module = inner
        self.hugging_face = hugging_face
        self.causal = causal
        # transformers 4.50+ computes the logits of the last positions only when asked (``logits_to_keep``)
        self.keep_last = causal and "logits_to_keep" in inspect.signature(inner.forward).parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hugging_face:
            return first_tensor(self.inner(x))
        if not self.causal:
            return self.inner(input_ids=x).last_hidden_state
        # a serving call of an LM: the whole sequence once, no KV cache (generation has its own path), and the
        # next token's logits only: the vocabulary projection of every position is most of the time otherwise
        if self.keep_last:
            return self.inner(input_ids=x, use_cache=False, logits_to_keep=1).logits
        return self.inner(input_ids=x, use_cache=False).logits[:, -1:]


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise BadInput(f"the model returned a {type(out).__name__}: serving needs a tensor (or a tuple starting with one)")


def load_subject(
    model: str | ModelSpec,
    *,
    weights: Path | None = None,
    seq_len: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    factory_folder: Path | None = None,
) -> Subject:
    """The model SPEC names (a string as ``-m`` takes it, or parsed), in eval mode with ``weights`` loaded;
    BadInput (one line) for anything unusable. ``factory_folder``: a factory is imported from there or an
    installed package only (an artifact's)."""
    if seq_len is not None and seq_len < 1:
        raise BadInput(f"--seq-len must be at least 1, not {seq_len}")
    spec = model if isinstance(model, ModelSpec) else parse_model_spec(model)
    name = spec.preset
    if spec.kind is ModelKind.FACTORY:
        subject = _factory(spec.text, input_shape, factory_folder)
    elif spec.kind is ModelKind.CONFIG:
        from redline.workload.hf import read_config

        assert spec.path is not None
        subject = _hugging_face(str(spec.path), read_config(spec.path), seq_len)
    elif name in TRACED_PRESET_NAMES:
        from redline.workload.presets import traced_presets

        preset = traced_presets()[name]
        shape = input_shape or preset.input_shape
        module = preset.build()  # typed object: workload's preset list imports no torch
        if not isinstance(module, nn.Module):
            raise TypeError(f"preset {name} built a {type(module).__name__}, not a torch module")
        subject = Subject(name, Served(module), "classifier", shape, torch.float32, source={"preset": name})
    elif name in TRANSFORMER_PRESETS:
        subject = _hugging_face(name, preset_config(name), seq_len)
    else:  # unreachable today; a new preset kind must say how it is served
        raise BadInput(f"preset '{spec.text}' cannot be served yet")
    if math.prod(subject.sample_shape) > MAX_SAMPLE_ELEMENTS:
        raise BadInput(
            f"one sample of {subject.sample_shape} is past what redline infer feeds ({MAX_SAMPLE_ELEMENTS:,} values)"
        )
    subject.served.eval()
    if weights is not None:
        load_weights(subject.served, weights)
        subject.source["weights"] = str(weights)
    return subject


def preset_config(name: str) -> dict[str, Any]:
    """A transformer preset as the config.json its model type would have (random weights, nothing downloaded)."""
    shape: TransformerShape = TRANSFORMER_PRESETS[name]
    if name.startswith("gpt2"):
        return {
            "model_type": "gpt2",
            "n_embd": shape.hidden,
            "n_layer": shape.layers,
            "n_head": shape.heads,
            "vocab_size": shape.vocab,
            "n_positions": shape.position_embeddings,
        }
    if name.startswith("bert"):
        return {
            "model_type": "bert",
            "hidden_size": shape.hidden,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "intermediate_size": shape.ffn_hidden,
            "vocab_size": shape.vocab,
            "max_position_embeddings": shape.position_embeddings,
        }
    if name.startswith("llama"):
        return {
            "model_type": "llama",
            "hidden_size": shape.hidden,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads or shape.heads,
            "intermediate_size": shape.ffn_hidden,
            "vocab_size": shape.vocab,
            "max_position_embeddings": shape.seq_len,
        }
    raise BadInput(f"preset '{name}' is an encoder-decoder: serve it from its config.json with a factory")


def _hugging_face(name: str, config: dict[str, Any], seq_len: int | None) -> Subject:
    from redline.capability import require_transformers

    require_transformers(f"serving {name}")
    import transformers

    try:
        hf_config = transformers.AutoConfig.for_model(**config)
    except Exception as exc:  # transformers raises its own validation errors, version by version
        raise BadInput(f"{name}: transformers cannot read this config: {one_line(exc, typed=False)}") from None
    if getattr(hf_config, "is_encoder_decoder", False):
        raise BadInput(f"{name}: an encoder-decoder model takes two inputs; serve it through a factory")
    causal = config["model_type"] not in ENCODERS
    positions = position_count(hf_config)
    length = seq_len or min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN)
    if positions and length > positions:
        raise BadInput(f"--seq-len {length} is longer than {name}'s {positions} positions")
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    try:
        inner = auto.from_config(hf_config, attn_implementation="sdpa")
    except Exception as exc:
        raise BadInput(f"{name}: transformers cannot build this model: {one_line(exc, typed=False)}") from None
    return Subject(
        name,
        Served(inner, hugging_face=True, causal=causal),
        "lm" if causal else "encoder",
        (length,),
        torch.long,
        vocab=int(hf_config.vocab_size),
        hf_config=hf_config,
        source={"config": config},
    )


def position_count(config: Any) -> int:
    """The positions a transformers config has room for (0 where it does not say: rotary models may not)."""
    return int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 0)


def _factory(spec: str, input_shape: tuple[int, ...] | None, folder: Path | None) -> Subject:
    from redline.workload.factory import load_factory

    module, shape = load_factory(spec, folder=folder)()
    shape = input_shape or shape
    if shape is None:
        raise BadInput(f"factory {spec} does not say its input's shape: give one sample's as --input-shape 3,32,32")
    return Subject(spec, Served(module), "other", tuple(shape), torch.float32, source={"factory": spec})


def load_weights(module: Served, path: Path) -> None:
    """A trained state into ``module``: every parameter the model has must be in it, and nothing else."""
    path = path.expanduser()
    if not path.exists():
        raise BadInput(f"--weights {path}: no such file or directory")
    target = module.inner
    if path.is_dir():
        state = _checkpoint_state(target, path)
    else:
        from redline.files import open_regular

        fd = open_regular(path, "--weights")  # a FIFO or a device refused before torch reads from it
        try:
            with os.fdopen(fd, "rb") as f:
                loaded = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise BadInput(f"--weights {path}: not a torch.save'd state_dict ({one_line(exc, typed=False)})") from None
        if isinstance(loaded, dict):
            loaded = loaded.get("model", loaded.get("state_dict", loaded))
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise BadInput(f"--weights {path}: holds no state_dict (a mapping of names to tensors)")
        state = {key.removeprefix("module.").removeprefix("_orig_mod."): value for key, value in loaded.items()}
    try:
        target.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = one_line(exc, typed=False).rstrip(":")
        raise BadInput(f"--weights {path} does not fit this model: {first}: {_key_summary(target, state)}") from None


def _checkpoint_state(target: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The model's state from a ``redline run`` checkpoint (its newest complete step when given the parent)."""
    import torch.distributed.checkpoint as dcp

    from redline.files import check_trusted

    trusted = check_trusted(path, "--weights checkpoint directory")  # DCP's metadata is a pickle: it runs code
    if trusted is None:
        raise BadInput(f"no such --weights checkpoint directory: {path}")
    folder = trusted.path  # as checked: the path given may cross a symlink repointed since
    if not (folder / ".metadata").exists():
        steps = sorted(p for p in folder.glob("step-*") if (p / "COMPLETE").exists())
        if not steps:
            raise BadInput(f"--weights {path}: neither a checkpoint step nor a directory of them")
        folder = steps[-1]
    state = {"model": target.state_dict()}
    trusted.confirm("--weights checkpoint directory")  # still the folder checked, just before it loads
    try:
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except Exception as exc:
        raise BadInput(f"--weights {path}: cannot read the model from it: {one_line(exc, typed=False)}") from None
    return state["model"]


def _key_summary(target: nn.Module, state: dict[str, Any]) -> str:
    own, given = set(target.state_dict()), set(state)
    missing, unexpected = sorted(own - given), sorted(given - own)
    parts = [f"{len(missing)} missing ({', '.join(missing[:2])}...)" if missing else ""]
    parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:2])}...)" if unexpected else "")
    return "; ".join(p for p in parts if p) or "shapes differ"


def rebuild(source: dict[str, Any], sample_shape: tuple[int, ...], folder: Path) -> Subject:
    """The subject the artifact in ``folder`` was made from, random weights (the caller loads the saved ones);
    a factory imported from ``folder`` or an installed package."""
    if "preset" in source:
        return load_subject(source["preset"], input_shape=sample_shape)
    if "factory" in source:  # a factory, never a path in whatever folder the loading program runs in
        return load_subject(parse_factory(source["factory"]), input_shape=sample_shape, factory_folder=folder)
    subject = _hugging_face(source.get("name", "the saved model"), source["config"], sample_shape[0])
    subject.served.eval()
    return subject
