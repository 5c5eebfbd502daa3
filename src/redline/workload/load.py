"""Turn what the user typed (``--model SPEC`` or ``--params N``) into a WorkloadProfile.

SPEC is a preset name, a Hugging Face ``config.json`` (or a directory holding one), or
``package.module:factory`` returning an ``nn.Module``, tried in that order (``workload.model_spec``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redline.capability import is_available, require_torch
from redline.errors import BadInput, one_line
from redline.units import fmt_count
from redline.workload.model_spec import FORMS, ModelKind, parse_model_spec
from redline.workload.presets import TRANSFORMER_PRESETS, preset_profile
from redline.workload.profile import TransformerShape, WorkloadProfile

if TYPE_CHECKING:
    from redline.workload.trace import TensorSplit

# A bare parameter count gets a GPT-shaped stack: GPT-3's 6.7B and 13B, Llama's 7B and 13B all keep
# about 128 model dimensions per layer (h = 128 L), so 12 L h^2 = N gives L = (N / (12 * 128^2))^(1/3).
WIDTH_PER_LAYER = 128
BARE_VOCAB = 32000
BARE_SEQ_LEN = 2048
MAX_BARE_PARAMS = 1e15


def load_workload(
    model: str | None,
    *,
    params: float | None = None,
    seq_len: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    analytic: bool = False,
    tensor_split: TensorSplit | None = None,
) -> WorkloadProfile:
    """The profile of ``model`` (or a bare ``params`` count); ``analytic`` takes a config.json's formulas where it
    would be traced, and refuses a model that has none (a factory, a traced preset). A traced model's layers
    count the parameters ``tensor_split`` names (``trace_module``)."""
    if seq_len is not None and seq_len < 1:
        raise BadInput(f"--seq-len must be at least 1, not {seq_len}")
    if (model is None) == (params is None):
        raise BadInput(f"give the model as --model SPEC ({FORMS}) or --params N")
    if params is not None:
        return bare_params_profile(params, seq_len)
    assert model is not None
    spec = parse_model_spec(model)
    if spec.kind is ModelKind.PRESET:
        if analytic and spec.preset not in TRANSFORMER_PRESETS:
            raise BadInput(f"--analytic: preset '{spec.text}' is traced, it has no formula")
        return preset_profile(spec.preset, seq_len)
    if spec.kind is ModelKind.CONFIG:
        assert spec.path is not None
        return config_profile(spec.path, seq_len, analytic=analytic, tensor_split=tensor_split)
    if analytic:
        raise BadInput(f"--analytic: {spec.text} is a factory; only a transformer's config.json has a formula")
    return factory_profile(spec.text, input_shape, tensor_split=tensor_split)


@dataclasses.dataclass(frozen=True)
class ModelBuild:
    """What it takes to run the model for real: a builder of the module and the shape of one sample's input."""

    build: Callable[[], Any]  # returns an nn.Module, or (module, input_shape) as a factory may
    input_shape: tuple[int, ...] | None


def model_builder(model: str, input_shape: tuple[int, ...] | None) -> ModelBuild:
    """The module behind a SPEC, to run real steps of it (``redline plan --calibrate``) on inputs of
    ``input_shape``, the shape its profile was traced with: redline's own traced presets, a Hugging Face
    config.json (the module the tracer built) or a factory. The transformer presets are formulas, with no
    module behind them."""
    require_torch(f"building {model}")
    from redline.workload.presets import TRACED_PRESET_NAMES, traced_presets

    spec = parse_model_spec(model)
    if spec.kind is ModelKind.PRESET:
        if spec.preset in TRACED_PRESET_NAMES:
            return ModelBuild(traced_presets()[spec.preset].build, input_shape)
        raise BadInput(
            f"preset '{spec.text}' is a formula with no module to run: calibrate with its config.json, "
            f"or a package.module:factory"
        )
    if spec.kind is ModelKind.CONFIG:
        path = spec.path
        assert path is not None
        if input_shape is None:  # profiled by the formulas: --analytic, or a layout that is not traced
            raise BadInput(f"{path} was profiled by formula, not traced: there is no module to run")
        from redline.workload.hf import KNOWN_MODEL_TYPES, read_config, shape_from_config

        config = read_config(path)
        shape = shape_from_config(config, None, origin=str(path)) if config["model_type"] in KNOWN_MODEL_TYPES else None
        return ModelBuild(_hf_module(config, path, shape)[1], input_shape)
    from redline.workload.factory import load_factory

    return ModelBuild(load_factory(spec.text), input_shape)


def bare_params_profile(params: float, seq_len: int | None) -> WorkloadProfile:
    """A GPT-shaped transformer of about ``params`` parameters; the counts are scaled to ``params`` exactly
    and the profile says the shape was assumed."""
    from redline.workload.transformer import transformer_profile

    if not 1e6 <= params <= MAX_BARE_PARAMS:
        raise BadInput(f"--params {params:g} is outside what a GPT shape can stand for (1e6 to {MAX_BARE_PARAMS:g})")
    # round so that tensor-parallel degrees up to 8 divide the heads: layers to 4s, width to 1024s
    layers = max(4, round((params / (12 * WIDTH_PER_LAYER**2)) ** (1 / 3) / 4) * 4)
    width = math.sqrt(params / (12 * layers))
    step = 1024 if width >= 1024 else WIDTH_PER_LAYER
    hidden = max(step, round(width / step) * step)
    shape = TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=hidden // WIDTH_PER_LAYER,
        ffn_hidden=4 * hidden,
        vocab=BARE_VOCAB,
        seq_len=seq_len or BARE_SEQ_LEN,
        tied_embeddings=False,
        norm="rmsnorm",
        bias=False,
        dropout=False,
    )
    profile = transformer_profile(shape, name=f"{fmt_count(params)} params", source="--params")
    scale = params / profile.params_total
    layers_scaled = tuple(
        dataclasses.replace(
            layer, params=round(layer.params * scale), forward_flops_per_sample=layer.forward_flops_per_sample * scale
        )
        for layer in profile.layers
    )
    return dataclasses.replace(
        profile,
        params_total=int(params),
        params_trainable=int(params),
        largest_module_params=round(profile.largest_module_params * scale),
        forward_flops_per_sample=profile.forward_flops_per_sample * scale,
        layers=layers_scaled,
        notes=(
            f"--params gives no layer structure: assumed a GPT-style shape of {layers} layers x {hidden} wide, "
            f"vocabulary {BARE_VOCAB}, sequence {shape.seq_len} (activations and tensor-parallel traffic come from "
            "that shape, parameters and FLOPs are scaled to the count); give --model for exact figures",
        ),
    )


def config_profile(
    path: Path, seq_len: int | None, *, analytic: bool = False, tensor_split: TensorSplit | None = None
) -> WorkloadProfile:
    """A Hugging Face config.json, read one way whatever is installed: traced through transformers (the module
    ``redline run`` trains), or by the transformer formulas where ``analytic`` asks for them or the layout cannot
    be traced (T5 needs decoder inputs). Without transformers a config to trace is refused, never read by the
    formulas instead: the two readings differ (Hugging Face's eager code saves more for backward than the
    formulas count, and the step times differ), so the same file would plan differently on another machine.
    The model is named from the config (``config_model_name``)."""
    from redline.workload.hf import KNOWN_MODEL_TYPES, read_config, shape_from_config
    from redline.workload.transformer import transformer_profile

    config = read_config(path)
    model_type = config["model_type"]
    known = model_type in KNOWN_MODEL_TYPES
    if analytic and not known:
        known_types = ", ".join(sorted(KNOWN_MODEL_TYPES))
        raise BadInput(f"--analytic: no formula for model_type '{model_type}' (known: {known_types})")
    # a known layout is checked even when it is traced: a malformed config is an error, not a surprising model
    shape = shape_from_config(config, seq_len, origin=str(path)) if known else None
    if analytic or model_type == "t5":
        assert shape is not None
        profile = transformer_profile(shape, name=model_type, source=f"config {path}")
    else:
        _require_tracer(path, known)
        profile = _trace_hf(config, path, shape, seq_len, tensor_split)
    return dataclasses.replace(profile, name=config_model_name(config, profile.params_total))


def _require_tracer(path: Path, known: bool) -> None:
    """BadInput in one line where what tracing a config takes is missing: transformers (the ``hf`` extra), then
    PyTorch (which that extra leaves to the user, as the build depends on the machine)."""
    if not is_available("transformers"):
        formula = ", or --analytic for the transformer formulas" if known else ""
        file = path / "config.json" if path.is_dir() else path
        raise BadInput(
            f"{file} is a Hugging Face model config; reading it needs transformers "
            f"(the hf extra: pip install transformers){formula}"
        )
    require_torch(f"tracing {path}")


def config_model_name(config: dict[str, Any], params: int) -> str:
    """What a config.json's model is called: the name it was saved under (``_name_or_path``: a hub id or the
    folder ``save_pretrained`` wrote), else its model type and size ("llama 1.1B"). Never the folder the file sits
    in, which says nothing about the model (``read_config`` has made sure there is a model type)."""
    saved = config.get("_name_or_path")
    if isinstance(saved, str) and saved.strip():
        return saved.strip()
    return f"{config['model_type']} {fmt_count(params)}"


def _trace_hf(
    config: dict,
    path: Path,
    shape: TransformerShape | None,
    seq_len: int | None,
    tensor_split: TensorSplit | None = None,
) -> WorkloadProfile:
    import torch
    import transformers

    from redline.workload.trace import trace_module

    hf_config, build = _hf_module(config, path, shape)
    length = seq_len or (
        shape.seq_len if shape else min(int(getattr(hf_config, "max_position_embeddings", 2048)), 8192)
    )
    vocab = int(getattr(hf_config, "vocab_size", 0)) or None
    profile = trace_module(
        build,
        (length,),
        name=str(path),  # what the tracer's errors call it; the caller names the model once its size is known
        source=f"config {path}, transformers {transformers.__version__}",
        input_dtype=torch.long,
        tokens_per_sample=length,
        sample_unit="sequence",
        vocab_size=vocab,
        tensor_split=tensor_split,
    )
    if shape is not None:
        profile = dataclasses.replace(profile, transformer=shape.replace(seq_len=length))
    return profile


def _hf_module(config: dict, path: Path, shape: TransformerShape | None) -> tuple[Any, Callable[[], Any]]:
    """The transformers config of a config.json and a builder of the module it describes: the bare model for
    an encoder (a known layout without an LM head), else the causal LM."""
    import transformers

    try:
        hf_config = transformers.AutoConfig.for_model(**config)
    except Exception as exc:  # transformers raises its own validation errors, version by version
        raise BadInput(f"{path}: transformers cannot read this config: {one_line(exc, typed=False)}") from None
    auto = transformers.AutoModel if shape is not None and not shape.lm_head else transformers.AutoModelForCausalLM

    def build() -> Any:
        return auto.from_config(hf_config)

    return hf_config, build


def factory_profile(
    spec: str, input_shape: tuple[int, ...] | None, *, tensor_split: TensorSplit | None = None
) -> WorkloadProfile:
    require_torch(f"tracing {spec}")
    from redline.workload.factory import load_factory
    from redline.workload.trace import trace_module

    build = load_factory(spec)
    return trace_module(build, input_shape, name=spec, source=f"factory {spec}", tensor_split=tensor_split)
