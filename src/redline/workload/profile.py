"""What the planner needs to know about a model: a plain, JSON-ready profile.

A ``WorkloadProfile`` comes from one of two places and reads the same either way:

- the analytic formulas for transformers (``workload.transformer``), from a preset, a Hugging Face
  ``config.json`` or a bare parameter count; or
- tracing a real ``nn.Module`` on fake tensors (``workload.trace``): no memory is allocated, no GPU needed.

Per-sample figures scale linearly with the micro-batch; the planner multiplies. A *sample* is one
sequence of ``tokens_per_sample`` tokens for a language model and one image for a vision model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

# How activations are stored: "16bit" under autocast to fp16/bf16 (and fp8, whose recipes keep 16-bit
# copies for the backward pass), "fp32" without mixed precision.
ActivationPrecision = Literal["16bit", "fp32"]
ACTIVATION_PRECISIONS: tuple[ActivationPrecision, ...] = ("16bit", "fp32")


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a transformer, enough for the analytic formulas (Megatron/Korthikanti notation)."""

    layers: int  # L: transformer blocks (encoder + decoder for an encoder-decoder model)
    hidden: int  # h: model width
    heads: int  # a: attention (query) heads
    ffn_hidden: int  # f: MLP inner width (4h for GPT-2, 11008 for Llama-2-7B)
    vocab: int  # V
    seq_len: int  # s: the training sequence length the preset or config names
    kv_heads: int | None = None  # G: key/value heads under grouped-query attention; None = heads
    head_dim: int | None = None  # None = hidden // heads (T5-3B has 32 heads of 128 on a 1024 model)
    gated_mlp: bool = False  # SwiGLU/GeGLU: three MLP matrices instead of two
    tied_embeddings: bool = True  # the output projection reuses the input embedding
    position_embeddings: int = 0  # learned absolute positions (GPT-2 1024, BERT 512); 0 for RoPE/relative
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True  # linear layers carry biases (GPT-2, BERT) or not (Llama, T5)
    dropout: bool = True  # dropout layers are active in training (they save 1-byte masks)
    lm_head: bool = True  # ends in a projection onto the vocabulary (False for a bare encoder like BertModel)
    final_norm: bool = True  # a norm after the last block (pre-norm models); BERT's post-norm blocks have none
    decoder_layers: int = 0  # of ``layers``, how many are decoder blocks with cross-attention (T5)
    extra_params: int = 0  # parameters outside the blocks and embeddings (BERT's pooler, type embeddings)
    # how the implementation stores activations, for the activation formulas (not the architecture):
    # a 16-bit step's residual stream where the framework fixes it (2: Megatron-LM's bf16 under every sharding; 4);
    # None: as redline's runtime keeps it for each strategy (``plan.dtypes.residual_bytes``). The profile's own
    # 16-bit figures hold it at ``residual_bytes or 4``, as autocast alone keeps it (and the tracer measures it)
    residual_bytes: int | None = None
    fused_gated_activation: bool = False  # one kernel for act(gate) * up (Megatron's SwiGLU) keeps only its input

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerShape.{name} must be positive, not {getattr(self, name)}")
        if self.kv_heads is not None and (self.kv_heads <= 0 or self.heads % self.kv_heads):
            raise ValueError(f"kv_heads {self.kv_heads} must divide heads {self.heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}; give head_dim")
        if self.residual_bytes not in (None, 2, 4):
            raise ValueError(f"residual_bytes must be 2 or 4 (or None: the runtime's), not {self.residual_bytes}")
        if not 0 <= self.decoder_layers <= self.layers:
            raise ValueError(f"decoder_layers {self.decoder_layers} must be within 0..layers {self.layers}")

    @property
    def groups(self) -> int:
        """G: key/value heads (equal to ``heads`` without grouped-query attention)."""
        return self.kv_heads or self.heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def query_width(self) -> int:
        """q: width of the query projection, heads x head_dim (= hidden except in T5-style models)."""
        return self.heads * self.dim_per_head

    def replace(self, **changes: Any) -> TransformerShape:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LayerGemm:
    """One matrix product of a layer's forward pass for one sample: ``count`` products of a ``rows`` x ``inner``
    matrix by an ``inner`` x ``cols`` one (a linear layer: rows are the sample's tokens; an attention core: one
    product per head). The planner times each by its shape at the micro-batch and tensor-parallel split it plans,
    and its backward as the two products of the same FLOPs that give the input's and the weights' gradients."""

    rows: int  # M for one sample
    cols: int  # N
    inner: int  # K
    count: int = 1  # products of this shape per sample
    batched: bool = False  # the micro-batch multiplies ``count`` (a batched matmul), not ``rows`` (a linear layer)
    tensor_split: Literal["cols", "inner", "count"] = "cols"  # the dimension tensor parallelism divides
    attention_core: bool = False  # QK^T or the attention over V: what selective checkpointing reruns unfused

    @property
    def flops_per_sample(self) -> float:
        return 2.0 * self.rows * self.cols * self.inner * self.count


@dataclass(frozen=True)
class LayerProfile:
    """One repeated block (or a non-repeated part such as the embedding) of the model."""

    name: str  # "h.0", "layers.0", "embedding", "head"
    kind: str  # module class or role: "GPT2Block", "LlamaDecoderLayer", "Bottleneck"
    params: int
    forward_flops_per_sample: float
    # bytes saved for the backward pass, per sample, by activation precision
    activation_bytes_per_sample: dict[str, float]
    # bytes of the layer's input per sample by activation precision, in the dtype it arrives in (under autocast a
    # residual stream stays fp32): what full activation checkpointing keeps of a block
    input_bytes_per_sample: dict[str, float] = field(default_factory=dict)
    # the part of the activations the training loop holds to the end of the step (the model's output, which
    # no layer's backward frees)
    held_bytes_per_sample: dict[str, float] = field(default_factory=dict)
    # bytes saved for the backward pass once per micro-batch whatever its size, by activation precision: tensors
    # made for the sequence, not per sample (position ids, Llama's rotary cos/sin tables, the loss's total weight).
    # Measured by the tracer (the constant of its fit in the batch); empty where not measured
    activation_fixed_bytes: dict[str, float] = field(default_factory=dict)
    # of a block, the bytes of the per-micro-batch tensors it is given beside its input (position ids, rotary
    # tables), by activation precision: what a checkpointed block keeps of them. All blocks share the same
    # tensors, so a stage keeps them once. Measured by the tracer; empty where not measured
    input_fixed_bytes: dict[str, float] = field(default_factory=dict)
    # of a block's activations per sample, by activation precision, those tensor parallelism splits over the ranks
    # (made from its column-wise layers' outputs), and its column-wise layers' inputs, which each rank holds whole
    # even under sequence parallelism: traced as the runtime's plan lays the block out; empty where not traced
    # so (the planner then scales the block by Korthikanti's split)
    tensor_split_bytes_per_sample: dict[str, float] = field(default_factory=dict)
    gathered_bytes_per_sample: dict[str, float] = field(default_factory=dict)
    # measured by the tracer, by activation precision, as lines (bytes, bytes per sample): at micro-batch m the
    # figure is the largest ``bytes + m x bytes per sample``. Empty where not measured (the planner then takes what
    # the layer saves). How far memory rises while the layer's forward runs above what the layers before it saved
    # (what it saves, its temporaries, its input where no layer before saved it, autocast's copies of its weights):
    forward_rise: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # what a block's backward needs at its most on top of what it saved, which it frees as it goes (the gradient it
    # is given, activation gradients, temporaries, its weight gradients as they arrive):
    backward_working: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # bytes per sample a block keeps under selective checkpointing beyond its input (the outputs of the operators
    # ``workload.selective`` saves), by activation precision: measured by the tracer, as the runtime checkpoints;
    # empty where not measured (the planner then takes Korthikanti's formula, or what the block saves)
    selective_bytes_per_sample: dict[str, float] = field(default_factory=dict)
    # parameters of embedding tables (lookups): autocast leaves them in fp32, and their backward writes a dense
    # gradient of the whole table
    table_params: int = 0
    # of the other parameters, those autocast copies into 16 bits (a matmul's or convolution's weights, not a norm's
    # or those of an operator autocast does not know): measured by the tracer; None, all of them, where not
    cast_params: int | None = None
    # of all its parameters, those tensor parallelism splits over the ranks (the column-wise layers' weights and
    # biases, the row-wise layers' weights, a vocabulary-split table), as the runtime's plan for this model names
    # them; None where the tracer was not given the plan (the planner then splits the cast weights and tables)
    tensor_split_params: int | None = None
    # of those, the ones FSDP2 beside tensor parallelism keeps whole on each data rank instead of sharding them
    # over the data ranks (a packed projection's 1-D bias: GPT-2's c_attn), as the runtime names them
    replicated_beside_fsdp_params: int = 0
    is_block: bool = True  # a repeated block (checkpointed, split over pipeline stages) or a fixed part
    # the matrix products of the forward pass by shape, which the planner times one by one; empty where not known
    # (the planner then runs the layer's FLOPs at the device's large-GEMM rate)
    gemms: tuple[LayerGemm, ...] = ()


@dataclass(frozen=True)
class Calibration:
    """How this model's training steps really ran on this machine's device, against what the planner
    predicted for the same runs: ``redline plan --calibrate`` measures a few steps at two micro-batch sizes
    (and at micro-batch 1 for the floor).

    Each measured quantity is fitted as a line in the micro-batch, ``a + b x m``, as is the prediction for
    the same runs; the planner then keeps its own model and corrects it with the two lines' ratio of slopes
    (``*_scale``: what each extra sample really costs) and difference of intercepts (``*_offset``: fixed costs
    per micro-batch its roofline does not see, such as kernel launches of eager PyTorch). Memory is fitted the
    same way where the device reports it (CUDA); the optimizer step, which does not depend on the micro-batch,
    by its ratio. A step at micro-batch 1, when the model takes one, gives the floor: on a fast GPU a small
    micro-batch takes as long as Python needs to launch its kernels, whatever the line says.
    """

    device: str
    precision: str
    micro_batches: tuple[int, int]
    measured_compute_s: tuple[float, float]  # forward + backward of one micro-batch
    predicted_compute_s: tuple[float, float]
    measured_optimizer_s: float
    predicted_optimizer_s: float
    measured_peak_bytes: tuple[int, int] | None  # torch.cuda.max_memory_allocated; None off CUDA
    predicted_peak_bytes: tuple[float, float]
    # forward + backward of a micro-batch of 1: the floor no micro-batch goes below, where the GPU waits for
    # eager PyTorch to launch its kernels (None: not measured)
    measured_floor_s: float | None = None

    def _fit(self, measured: tuple[float, float], predicted: tuple[float, float]) -> tuple[float, float, float]:
        """(measured slope / predicted slope, measured intercept, predicted intercept) of the two lines through
        the calibration's micro-batch sizes; a slope that is not positive (noise) leaves the scale at 1."""
        (m1, m2), (y1, y2), (p1, p2) = self.micro_batches, measured, predicted
        measured_slope, predicted_slope = (y2 - y1) / (m2 - m1), (p2 - p1) / (m2 - m1)
        scale = measured_slope / predicted_slope if predicted_slope > 0 and measured_slope > 0 else 1.0
        return scale, y1 - measured_slope * m1, p1 - predicted_slope * m1

    @property
    def compute(self) -> tuple[float, float]:
        """(scale, offset seconds per micro-batch): corrected = scale x predicted + offset."""
        scale, measured_at0, predicted_at0 = self._fit(self.measured_compute_s, self.predicted_compute_s)
        return scale, measured_at0 - scale * predicted_at0

    def corrected_compute_s(self, predicted_s: float, floor_share: float = 1.0) -> float:
        """Forward + backward of one micro-batch as this device runs it, from the planner's prediction; the floor
        scaled by ``floor_share``, the part of the whole model's kernel launches the prediction covers (a
        pipeline stage's layers, plus a recomputed forward)."""
        scale, offset = self.compute
        return max(scale * predicted_s + offset, (self.measured_floor_s or 0.0) * floor_share)

    @property
    def launch_bound(self) -> bool:
        """The smallest calibration size above 1 ran within 20% of the floor: the line through it is mostly
        launch time."""
        floor = self.measured_floor_s
        above = [s for m, s in zip(self.micro_batches, self.measured_compute_s, strict=True) if m > 1]
        return floor is not None and above[0] < 1.2 * floor

    @property
    def optimizer_scale(self) -> float:
        return self.measured_optimizer_s / self.predicted_optimizer_s if self.predicted_optimizer_s > 0 else 1.0

    @property
    def memory(self) -> tuple[float, float] | None:
        """(scale, offset bytes), or None where memory was not measured: corrected peak = predicted peak +
        (scale - 1) x the predicted parts that grow with the micro-batch (activations, the backward working
        set) + offset; the fixed part (model states, workspaces) is corrected by the offset alone."""
        if self.measured_peak_bytes is None:
            return None
        measured = (float(self.measured_peak_bytes[0]), float(self.measured_peak_bytes[1]))
        scale, measured_at0, predicted_at0 = self._fit(measured, self.predicted_peak_bytes)
        return scale, measured_at0 - predicted_at0

    def to_dict(self) -> dict[str, Any]:
        compute_scale, compute_offset = self.compute
        memory = self.memory
        return dataclasses.asdict(self) | {
            "compute_scale": compute_scale,
            "compute_offset_s": compute_offset,
            "optimizer_scale": self.optimizer_scale,
            "memory_scale": None if memory is None else memory[0],
            "memory_offset_bytes": None if memory is None else memory[1],
        }


@dataclass(frozen=True)
class WorkloadProfile:
    """A model as the planner sees it. Counts are exact for traced modules, formula-based otherwise."""

    name: str
    source: str  # where it came from: "preset gpt2", "config.json path", "mypkg.models:build", "--params"
    method: Literal["analytic", "traced"]
    params_total: int
    params_trainable: int
    largest_module_params: int  # parameters of the largest single module (DeepSpeed's LL)
    forward_flops_per_sample: float  # model FLOPs of one forward pass; backward is 2x (6ND rule)
    layers: tuple[LayerProfile, ...]  # embedding, blocks in order, head
    tokens_per_sample: int = 1  # sequence length for language models, 1 for images
    sample_unit: str = "sequence"  # "sequence" or "image"
    transformer: TransformerShape | None = None  # present when the analytic formulas apply
    input_shape: tuple[int, ...] | None = None  # per-sample input shape a traced model was run with
    # a language model trained with cross-entropy over this many entries (its loss's backward holds b x s x V
    # fp32 gradients); None for any other model
    loss_vocab: int | None = None
    tied_params: int = 0  # parameters of the first layer (an embedding table) the last one uses too
    # traced models: peak bytes of one fp32 Adam step at micro-batch 1 by category ("params", "grads",
    # "optimizer_states", "activations", "temporary", "total", ...), from PyTorch's MemTracker; None without it
    traced_peak_bytes: dict[str, int] | None = None
    notes: tuple[str, ...] = field(default=())
    calibration: Calibration | None = None  # measured on this machine (redline plan --calibrate)

    @property
    def training_flops_per_sample(self) -> float:
        """Forward + backward model FLOPs (3x forward: the backward pass costs twice the forward)."""
        return 3.0 * self.forward_flops_per_sample

    @property
    def blocks(self) -> tuple[LayerProfile, ...]:
        return tuple(layer for layer in self.layers if layer.is_block)

    def activation_bytes_per_sample(self, precision: ActivationPrecision = "16bit") -> float:
        return sum(layer.activation_bytes_per_sample[precision] for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["training_flops_per_sample"] = self.training_flops_per_sample
        data["calibration"] = self.calibration.to_dict() if self.calibration else None
        data["activation_bytes_per_sample"] = {p: self.activation_bytes_per_sample(p) for p in ACTIVATION_PRECISIONS}
        return data
