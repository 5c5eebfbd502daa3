"""Profile a real ``nn.Module`` on fake tensors: exact parameters, FLOPs and saved activations, no memory, no GPU.

The module is built and run under ``FakeTensorMode``: every tensor has a shape, a dtype and a (fake) storage but
no data, so a 7B model costs no RAM and a forward pass costs only the Python overhead of its operators. Over
that forward pass:

- ``FlopCounterMode`` counts model FLOPs (2 per multiply-accumulate, as PyTorch's formulas count them);
- ``saved_tensors_hooks`` sees every tensor autograd keeps for the backward pass; their storages, counted once
  each and excluding parameters and buffers, are the activation memory (Korthikanti et al. 2022 count the same
  thing by hand). It is measured in fp32 and under autocast to bfloat16 ("16bit") with CUDA's policy of which
  ops stay in fp32 (``cuda_autocast``) and attention as a fused kernel, as a GPU runs them;
- forward hooks on the repeated blocks (GPT-2's ``h``, Llama's ``layers``, ResNet's Bottlenecks) split both
  figures into the part before the blocks, each block, and the part after;
- a dispatch mode follows every storage the operators allocate until it is freed, as PyTorch's MemTracker does,
  through the forward and the backward pass (hooks on each block's output mark where its backward begins):
  how far memory rises while each part's forward runs, and what each block's backward needs on top of what it
  saved, which it frees as it goes.

Each figure is measured at two batch sizes and the per-sample value is the difference divided by the batch
difference: what grows with the batch, without constant terms (a broadcast mask, autocast's bf16 copies of the
weights) and without special cases a batch of 1 can take. The working sets are maxima over a pass, whose place
can move with the batch: they are kept as lines, one per operator (what was live after it, at the two batch
sizes), of which those that are the largest at some micro-batch.

Finally one Adam training step runs under PyTorch's private ``MemTracker`` for its peak memory by category; if
that API is missing or fails the profile says so and the planner's analytic memory model stands alone.

This module holds the entry and the tracer; beside it, ``kernels.py`` has the GPU's kernels for a CPU trace
(fused attention, experts) and their FLOP formulas, ``measured_memory.py`` the live-bytes mode and the
``MemTracker`` step, and ``user_model.py`` what is asked of the user's model (its builder, input and loss).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter

from redline.errors import BadInput, one_line
from redline.workload.cuda_autocast import cuda_autocast_policy
from redline.workload.kernels import (
    flop_formulas,
    fused_attention,
    gemms_per_sample,
    recording_formulas,
    traceable_experts,
)
from redline.workload.measured_memory import (
    LiveBytes,
    selective_saved_bytes,
    storage_bytes,
    tensor_leaves,
    training_step_peak,
)
from redline.workload.profile import (
    ACTIVATION_PRECISIONS,
    ActivationPrecision,
    LayerGemm,
    LayerProfile,
    WorkloadProfile,
)
from redline.workload.split_marks import SplitMarks, TensorSplitPlan
from redline.workload.structure import find_blocks, without_kv_cache
from redline.workload.user_model import input_kind, lm_logits, training_loss, unpack_build

# what tensor parallelism splits of a module over its ranks, its parameters and its layers' outputs (the runtime's
# plan for the module, which the planner cannot import), or None where there is no plan for it
TensorSplit = Callable[[nn.Module], TensorSplitPlan | None]

# Two batch sizes; per-sample figures are their slope. Neither is 1: some models squeeze a batch of one.
BATCHES = (2, 4)
MAX_MESSAGE_CHARS = 300

_FAKE_TENSOR_LIMITS = (DataDependentOutputException, DynamicOutputShapeException)


def trace_module(
    build: Callable[[], Any],
    input_shape: tuple[int, ...] | None,
    *,
    name: str,
    source: str,
    input_dtype: torch.dtype | None = None,
    tokens_per_sample: int | None = None,
    sample_unit: str | None = None,
    vocab_size: int | None = None,
    tensor_split: TensorSplit | None = None,
) -> WorkloadProfile:
    """Build ``build()`` on fake tensors, run it, and return its ``WorkloadProfile`` (method "traced").

    ``build`` returns an ``nn.Module``, or ``(module, input_shape)`` as a factory may. ``input_shape`` is the
    shape of one sample without the batch dimension: ``(3, 224, 224)`` for an image, ``(seq_len,)`` for token
    ids; ``None`` takes the shape ``build`` returned. An integer ``input_dtype`` means token ids, drawn below
    ``vocab_size``. Left out, they are inferred: token ids below its size when the model's first module with
    parameters is an ``nn.Embedding`` (a language model), float32 otherwise; ``sample_unit`` is then
    "sequence" (``tokens_per_sample`` the last input dimension) or "image" (1). Anything the module cannot do
    on fake tensors raises ``BadInput`` as one line, "cannot trace NAME: ExcType: message". ``tensor_split``
    names the parameters tensor parallelism would split in the module (the runtime's plan for it; None where it
    has none): each layer's count of its parameters is its ``tensor_split_params``, of those FSDP2 keeps whole
    beside it its ``replicated_beside_fsdp_params``, and a block's saved activations made from its column-wise
    layers' outputs its ``tensor_split_bytes_per_sample``.
    """
    started_s = time.perf_counter()
    # Real tensors a module holds outside its parameters (constants made at import time) become fake on use.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        with _skipped_init():
            module, built_shape = _guarded(name, lambda: unpack_build(build(), name))
        shape = _check_shape(name, input_shape if input_shape is not None else built_shape)
        _make_fake(module)
        without_kv_cache(module)  # as the runtime trains it
        module.train()  # dropout masks and batch-norm statistics are part of a training step
        input_dtype, vocab_size, input_note = input_kind(module, input_dtype, vocab_size)
        token_ids = not input_dtype.is_floating_point and not input_dtype.is_complex
        if sample_unit is None:
            sample_unit = "sequence" if token_ids else "image"
        if tokens_per_sample is None:
            tokens_per_sample = shape[-1] if token_ids else 1
        tracer = _Tracer(module, shape, input_dtype, vocab_size, name)
        split = tensor_split(module) if tensor_split is not None else None
        if split is not None and split.columns:
            tracer.marks = SplitMarks(module, split)
        if input_note:
            tracer.notes.insert(0, input_note)
        with traceable_experts():
            tracer.measure()
            peak_bytes, peak_note = training_step_peak(
                tracer.module, tracer.make_input, tracer.attention, tracer.vocab_size
            )
    notes = [*tracer.notes, peak_note]
    notes.append(
        f"traced in {time.perf_counter() - started_s:.1f} s on fake tensors (batches {BATCHES[0]} and "
        f"{BATCHES[1]}); a language model's cross-entropy counts with its head"
    )
    return WorkloadProfile(
        name=name,
        source=source,
        method="traced",
        params_total=tracer.params_total,
        params_trainable=tracer.params_trainable,
        largest_module_params=tracer.largest_module_params,
        forward_flops_per_sample=tracer.forward_flops_per_sample,
        layers=tracer.layer_profiles(*tracer.count_split(split)),
        tokens_per_sample=tokens_per_sample,
        sample_unit=sample_unit,
        input_shape=shape,
        loss_vocab=tracer.loss_vocab,
        tied_params=tracer.tied_params,
        traced_peak_bytes=peak_bytes,
        notes=tuple(notes),
    )


# --- the user's module on fake tensors, and its errors as one line ----------------------------------------


def _guarded(name: str, call: Callable[[], Any]) -> Any:
    """Run the user's code; anything it raises becomes one line of BadInput naming the model."""
    try:
        return call()
    except BadInput:
        raise
    except Exception as error:
        raise _cannot_trace(name, error) from error


def _cannot_trace(name: str, error: BaseException) -> BadInput:
    message = one_line(error, limit_chars=MAX_MESSAGE_CHARS)
    if isinstance(error, _FAKE_TENSOR_LIMITS):
        message += " (the model's code depends on tensor values, which fake tensors do not have)"
    return BadInput(f"cannot trace {name}: {message}")


def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if shape is None:
        raise BadInput(f"cannot trace {name}: no input shape (give one, or return (module, input_shape))")
    try:
        dims = tuple(int(dim) for dim in shape)
    except (TypeError, ValueError):
        raise BadInput(f"cannot trace {name}: input shape {shape!r} is not a tuple of integers") from None
    if not dims or any(dim <= 0 for dim in dims):
        raise BadInput(f"cannot trace {name}: input shape {shape!r} needs positive dimensions")
    return dims


# torch.nn.init's in-place initialisers; values mean nothing on fake tensors, and some need them (trunc_normal_
# resamples until every value is in range, which a fake tensor cannot answer)
_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextmanager
def _skipped_init() -> Iterator[None]:
    """Make torch.nn.init's initialisers no-ops on fake tensors while the model is built (what
    ``torch.nn.utils.skip_init`` and Accelerate's ``init_empty_weights`` do for real tensors). Code that imported
    one by name still runs it. A library that records the initialisers when it is first imported, as
    transformers' ``initialization`` module does, may record these stand-ins if the build imports it: on real
    tensors they initialise as the originals do, so every model that library builds later is initialised."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}
    try:
        for name, initialiser in saved.items():
            setattr(nn.init, name, _on_real_tensors_only(initialiser))
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def _on_real_tensors_only(initialiser: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(initialiser)
    def skip_fake(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):
            return tensor
        return initialiser(tensor, *args, **kwargs)

    return skip_fake


def _make_fake(module: nn.Module) -> None:
    """Replace parameters and buffers built outside the fake mode (real, on meta, on another device) by fake
    CPU tensors of the same shape, keeping tied parameters tied. Call under the fake mode."""
    replaced: dict[int, torch.Tensor] = {}

    def fake_like(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor) and tensor.device.type == "cpu":
            return tensor
        if id(tensor) not in replaced:
            fake = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu")
            if isinstance(tensor, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
            replaced[id(tensor)] = fake
        return replaced[id(tensor)]

    for owner in module.modules():
        # a fake tensor takes a parameter's slot as it is, not as a Parameter: the module is only traced
        parameters = cast(dict[str, Any], owner._parameters)
        for slots in (parameters, owner._buffers):
            for key, tensor in slots.items():
                if tensor is not None:
                    slots[key] = fake_like(tensor)


# --- the tracer -------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    """A stretch of the forward pass: the part before the blocks, one block, or the part after."""

    name: str
    kind: str
    is_block: bool
    params: int = 0
    table_params: int = 0  # of them, in nn.Embedding / nn.EmbeddingBag tables
    cast_params: int = 0  # of the others, those autocast copied into 16 bits
    # per batch size: FLOPs; per batch size and precision: bytes saved for backward, bytes of the input (in the
    # dtype it arrives in: under autocast a residual stream stays fp32) and bytes held to the step's end
    flops: dict[int, float] = field(default_factory=dict)
    # per batch size: its forward's matrix products as (products, M, N, K, attention core), in the order they ran
    gemms: dict[int, list[tuple[int, int, int, int, bool]]] = field(default_factory=dict)
    saved_bytes: dict[tuple[int, str], float] = field(default_factory=dict)
    input_bytes: dict[tuple[int, str], float] = field(default_factory=dict)
    held_bytes: dict[tuple[int, str], float] = field(default_factory=dict)
    # a block's tensors given beside its input (position ids, rotary tables), per batch size and precision
    other_input_bytes: dict[tuple[int, str], float] = field(default_factory=dict)
    # of what a block saves, per batch size and precision, what tensor parallelism splits (made from a column-wise
    # layer's output) and the column-wise layers' inputs (whole on each rank): only where the plan was given
    split_bytes: dict[tuple[int, str], float] = field(default_factory=dict)
    gathered_bytes: dict[tuple[int, str], float] = field(default_factory=dict)
    # per batch size and precision, what was live after each operator of its forward above what the segments
    # before it saved, and of a block's backward above what was live as it began less the gradient it was given
    forward_live: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    backward_live: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    # per batch size and precision, what a block keeps under selective checkpointing beyond its input
    selective_bytes: dict[tuple[int, str], float] = field(default_factory=dict)


def _slope(values: dict[Any, float], key: Callable[[int], Any]) -> float:
    small, large = BATCHES
    return (values.get(key(large), 0.0) - values.get(key(small), 0.0)) / (large - small)


def _at(precision: str) -> Callable[[int], tuple[int, str]]:
    """The key of a figure taken at a batch size in ``precision``."""
    return lambda batch: (batch, precision)


def _intercept(values: dict[Any, float], key: Callable[[int], Any]) -> float:
    """The part of a figure that does not grow with the batch: the line through the two batch sizes at none (not
    below 0, where the batches ran differently)."""
    small, _ = BATCHES
    return max(0.0, values.get(key(small), 0.0) - small * _slope(values, key))


def _first_tensor(*trees: Any) -> torch.Tensor | None:
    leaves = tensor_leaves(*trees)
    return leaves[0] if leaves else None


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _lines(live: dict[tuple[int, str], list[int]], precision: str) -> tuple[tuple[float, float], ...]:
    """What was live after each operator at the two batch sizes, as lines in the batch (bytes at none, bytes per
    sample: the same operators ran at both), of which only those that are the largest at some micro-batch: the
    working set at micro-batch m is the largest ``c + m x``. Constant terms stay (a block's weight gradients as
    they arrive). Empty where it was not measured."""
    small, large = BATCHES
    at_small, at_large = live.get((small, precision)), live.get((large, precision))
    if not at_small or not at_large:
        return ()
    if len(at_small) != len(at_large):  # the batches ran different operators: their largest only
        at_small, at_large = [max(at_small)], [max(at_large)]
    lines = set()
    for a, b in zip(at_small, at_large, strict=True):
        per_sample = (b - a) / (large - small)
        lines.add((a - small * per_sample, per_sample))
    return upper_envelope(lines)


def upper_envelope(lines: Iterable[tuple[float, float]], start: float = 1.0) -> tuple[tuple[float, float], ...]:
    """Of lines ``(c, x)``, those that are the largest ``c + m x`` for some ``m >= start``, by slope: from the
    largest at ``start``, each next is the steeper line that overtakes the current one first."""
    lines = set(lines)
    current = max(lines, key=lambda line: (line[0] + start * line[1], line[1]))
    envelope, at = [current], start
    while steeper := [line for line in lines if line[1] > current[1]]:
        # where each steeper line overtakes the current one (none does before ``at``, where the current is the
        # largest); the first to, the steepest of those on a tie
        c, x = current
        at, _, current = min((max(at, (c - c2) / (x2 - x)), -x2, (c2, x2)) for c2, x2 in steeper)
        envelope.append(current)
    return tuple(envelope)


class _Tracer:
    """Runs the module on fake inputs and keeps what each segment did. Used under the fake mode."""

    def __init__(
        self, module: nn.Module, shape: tuple[int, ...], input_dtype: torch.dtype, vocab_size: int | None, name: str
    ) -> None:
        self.module = module
        self.shape = shape
        self.input_dtype = input_dtype
        self.vocab_size = vocab_size
        self.name = name
        self.notes: list[str] = []
        self.backward_flops: dict[int, float] = {}
        self.total_flops: dict[int, float] = {}

        params = {id(p): p for p in module.parameters()}  # parameters() yields a tied parameter once
        self.params_total = sum(p.numel() for p in params.values())
        self.params_trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        self.largest_module_params = max(
            (sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0
        )
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params.values()} - {"float32"})
        if dtypes:
            self.notes.append(f"parameters in {', '.join(dtypes)}: the fp32 figures keep them as they are")
        self.blocks = find_blocks(module)
        integer_input = not input_dtype.is_floating_point and not input_dtype.is_complex
        if self.blocks:
            first = _Segment("embedding" if integer_input else "stem", "embedding" if integer_input else "stem", False)
            self.segments = [first]
            self.segments += [_Segment(block_name, type(block).__name__, True) for block_name, block in self.blocks]
            self.segments.append(_Segment("head", "head", False))
        else:
            self.segments = [_Segment("model", type(module).__name__, False)]
            self.notes.append("no repeated blocks found: the model is one fixed part")

        # parameter and buffer storages are not activations even when autograd saves them (a Linear's weight)
        self.state_storages = {StorageWeakRef(t.untyped_storage()) for t in (*params.values(), *module.buffers())}
        self.current = 0  # index of the running segment
        self.head_uses: set[StorageWeakRef] = set()  # parameter storages the last segment saves for backward
        self.loss_vocab: int | None = None  # set when the step's loss is a language model's cross-entropy
        self.tied_params = 0  # parameters of the first segment the last one uses too (a tied LM head)
        self.block_depth = 0  # > 0 while a block runs (a block that calls another stays one segment)
        self.first_segment: dict[int, int] = {}  # id(module) -> segment running when it was first called
        self.between_blocks = False  # some FLOPs ran outside the blocks after the first one began
        self.attention = fused_attention()  # one instance, entered for every pass
        self.cast_storages: set[StorageWeakRef] = set()  # what autocast copied into 16 bits, over the 16-bit runs
        self.owner: dict[int, tuple[int, int]] = {}  # id(param) -> (segment, numel): where each parameter counts
        self.marks: SplitMarks | None = None  # where tensor parallelism's plan was given: what it splits

    # -- measuring

    def make_input(self, batch: int) -> torch.Tensor:
        if self.input_dtype.is_floating_point or self.input_dtype.is_complex:
            return torch.randn((batch, *self.shape), dtype=self.input_dtype)
        return torch.randint(0, self.vocab_size or 1, (batch, *self.shape), dtype=self.input_dtype)

    def measure(self) -> None:
        # the 16-bit runs take CUDA's autocast policy (its fp32 ops in fp32), as on the GPUs the planner predicts
        with cuda_autocast_policy():
            with self._segment_hooks(), self._first_call_hooks():
                for batch in BATCHES:
                    self._run(batch, "fp32", count_flops=True)
                    self._run(batch, "16bit", count_flops=False)
            self._measure_selective()
        self._assign_params()
        self.forward_flops_per_sample = _slope(self.total_flops, lambda b: b)
        self.backward_flops_per_sample = _slope(self.backward_flops, lambda b: b)
        if self.forward_flops_per_sample > 0:
            ratio = self.backward_flops_per_sample / self.forward_flops_per_sample
            self.notes.append(
                f"measured backward FLOPs per sample {self.backward_flops_per_sample:.4g}, {ratio:.2f}x the forward "
                "(the profile's training FLOPs assume 2x)"
            )
        if self.between_blocks:
            self.notes.append("work between blocks (outside any block) is counted in the head")
        if getattr(self.attention, "calls", 0):
            self.notes.append(
                "scaled_dot_product_attention measured as a fused kernel, as on a GPU: no s x s matrices saved"
            )

    def _run(self, batch: int, precision: ActivationPrecision, count_flops: bool) -> None:
        self.batch, self.precision = batch, precision
        self.current, self.block_depth, self.flops_mark = 0, 0, 0.0
        self.saved: set[StorageWeakRef] = set()
        self.keep_alive: list[Any] = []  # saved storages stay alive so that no other can reuse their address
        self.memory = LiveBytes()
        self.window: tuple[int, int] | None = None  # the block whose backward runs, and its base
        # bytes saved for backward in this run that live counts too; those saved before the running segment
        self.saved_total = self.saved_before = 0
        formulas = flop_formulas()
        forward_formulas = recording_formulas(self._record_gemm)
        self.counter = (
            flop_counter.FlopCounterMode(display=False, custom_mapping=forward_formulas) if count_flops else None
        )
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "16bit" else nullcontext()
        with (
            self.counter or nullcontext(),
            self.attention,
            autocast,
            torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved),
            self.marks.hooks() if self.marks else nullcontext(),
            self.marks or nullcontext(),
            self.memory,
        ):
            x = self.make_input(batch)
            self.segments[0].input_bytes[(batch, precision)] = _nbytes(x)
            # the input batch is held through the whole step, like the first layer's activations (it is one of
            # them in fp32; under autocast the first layer saves a 16-bit copy of it)
            self._pack(x)
            output = _guarded(self.name, lambda: self.module(x))
            self._charge_flops()
            # a training loop holds the model's output through the backward (``out = model(x)``, Hugging Face's
            # output object with its logits): memory of the step even where autograd saves none of it, and
            # memory no layer's backward frees
            leaves = tensor_leaves(output)
            for leaf in leaves:
                self._pack(leaf)
            held = storage_bytes(leaves)
            self.segments[self.current].held_bytes[(batch, precision)] = float(
                sum(nbytes for ref, nbytes in held.items() if ref not in self.state_storages)
            )
            # the loss (an LM's cross-entropy) runs after the last block: what it saves counts with the head
            loss = _guarded(self.name, functools.partial(training_loss, output, x, self.vocab_size))
            if lm_logits(output, x, self.vocab_size) is not None:
                self.loss_vocab = self.vocab_size
            self._forward_boundary()
        if self.counter is not None:
            self.total_flops[batch] = float(self.counter.get_total_flops())
        if precision == "16bit":
            self.cast_storages |= self.memory.converted
        # autograd frees what it saved as the backward goes; the forward's bookkeeping kept it alive
        self.saved.clear()
        self.keep_alive.clear()
        backward_flops = self._backward(loss, formulas)
        if self.counter is not None:
            self.backward_flops[batch] = backward_flops
        self.counter = None
        del output, loss

    def _measure_selective(self) -> None:
        """What each block keeps under selective checkpointing (``workload.selective``), by forward passes with
        the blocks checkpointed, as the runtime runs them (autocast without its weight cache). A model the
        checkpoint cannot run keeps no figure, and the planner its formula or what the block saves."""
        blocks = [block for _, block in self.blocks]
        if not blocks:
            return
        for batch in BATCHES:
            for precision in ACTIVATION_PRECISIONS:
                autocast = (
                    torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
                    if precision == "16bit"
                    else nullcontext()
                )
                x = self.make_input(batch)
                try:
                    with self.attention, autocast:
                        kept = selective_saved_bytes(blocks, functools.partial(self.module, x))
                except Exception as error:  # the user's block under torch.utils.checkpoint: any error of theirs
                    message = one_line(error, limit_chars=MAX_MESSAGE_CHARS)
                    self.notes.append(f"selective checkpointing not measured ({message})")
                    for segment in self.segments:
                        segment.selective_bytes.clear()
                    return
                for segment, nbytes in zip(self.segments[1 : 1 + len(blocks)], kept, strict=True):
                    segment.selective_bytes[(batch, precision)] = float(nbytes)

    def _backward(self, loss: torch.Tensor | None, formulas: dict[Any, Any]) -> float:
        """Run the backward pass from a first micro-batch's state (no gradients yet), measuring each block's
        working set; its FLOPs when this run counts them. The gradients stay: the training-step measurement
        creates Adam's states from them."""
        if loss is None:
            if not any("no output needs a gradient" in note for note in self.notes):
                self.notes.append("no output needs a gradient: backward FLOPs and working sets not measured")
            return 0.0
        for p in self.module.parameters():
            p.grad = None
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=formulas) if self.counter else None
        with counter or nullcontext(), self.attention, self.memory:
            self._backward_window(None)
            _guarded(self.name, loss.backward)
            self._backward_window(None)
        return float(counter.get_total_flops()) if counter else 0.0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts: count the tensor
            self._charge_bytes(_nbytes(tensor))
            return tensor
        ref = StorageWeakRef(storage)
        if ref in self.state_storages and self.current == len(self.segments) - 1:
            self.head_uses.add(ref)
        if ref not in self.state_storages and ref not in self.saved:
            self.saved.add(ref)
            self.keep_alive.append(storage)
            self._charge_bytes(storage.nbytes())
            self._charge_split(ref, storage.nbytes())
            if self.memory.holds(ref):  # made in this pass (not a constant from outside it): live counts it too
                self.saved_total += storage.nbytes()
        return tensor

    def _charge_bytes(self, nbytes: int) -> None:
        saved = self.segments[self.current].saved_bytes
        key = (self.batch, self.precision)
        saved[key] = saved.get(key, 0) + nbytes

    def _charge_split(self, ref: StorageWeakRef, nbytes: int) -> None:
        """Where the plan was given, charge a block's saved storage to what tensor parallelism splits or to the
        column-wise layers' gathered inputs, as it is marked."""
        segment = self.segments[self.current]
        if self.marks is None or not segment.is_block:
            return
        kind = self.marks.kind(ref)
        charged = segment.split_bytes if kind == "split" else segment.gathered_bytes if kind == "gathered" else None
        if charged is not None:
            key = (self.batch, self.precision)
            charged[key] = charged.get(key, 0) + nbytes

    def _record_gemm(self, products: int, m: int, n: int, k: int, attention_core: bool) -> None:
        """A matrix product of the forward pass, for the running segment."""
        self.segments[self.current].gemms.setdefault(self.batch, []).append((products, m, n, k, attention_core))

    def _charge_flops(self) -> float:
        """Give the FLOPs counted since the last boundary to the running segment; return them."""
        if self.counter is None:
            return 0.0
        total = float(self.counter.get_total_flops())
        flops = self.segments[self.current].flops
        flops[self.batch] = flops.get(self.batch, 0.0) + total - self.flops_mark
        charged, self.flops_mark = total - self.flops_mark, total
        return charged

    @contextmanager
    def _segment_hooks(self) -> Iterator[None]:
        handles = []
        for index, (_, block) in enumerate(self.blocks, start=1):

            def enter(_module: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
                self.block_depth += 1
                if self.block_depth == 1:
                    self._forward_boundary()
                    charged = self._charge_flops()
                    if self.current == len(self.segments) - 1 and charged > 0:
                        self.between_blocks = True
                    self.current = index
                    first = _first_tensor(args, kwargs)
                    self.segments[index].input_bytes[(self.batch, self.precision)] = _nbytes(first)
                    self.segments[index].other_input_bytes[(self.batch, self.precision)] = self._other_inputs(
                        first, args, kwargs
                    )
                    if index == 1:  # the first block's backward ends where the stem's begins
                        self._mark_backward(first, 0)

            def leave(_module: nn.Module, _args: Any, _kwargs: Any, output: Any, index: int = index) -> None:
                self.block_depth -= 1
                if self.block_depth == 0:
                    self._forward_boundary()
                    self._charge_flops()
                    self.current = len(self.segments) - 1  # whatever runs between or after blocks is the head
                    last = _first_tensor(output)
                    self.segments[-1].input_bytes[(self.batch, self.precision)] = _nbytes(last)
                    self._mark_backward(last, index)

            handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(block.register_forward_hook(leave, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _other_inputs(self, first: torch.Tensor | None, *trees: Any) -> float:
        """Bytes of the tensors a block is given beside its input ``first`` (parameters and buffers left out): the
        per-micro-batch tensors a model makes once for all its blocks (position ids, rotary tables)."""
        inputs = storage_bytes(tensor_leaves(*trees))
        if first is not None:
            inputs.pop(StorageWeakRef(first.untyped_storage()), None)
        return float(sum(nbytes for ref, nbytes in inputs.items() if ref not in self.state_storages))

    def _forward_boundary(self) -> None:
        """The running segment's forward ends: note the most that was live while it ran above what the segments
        before it saved (all else that is live then, its input among it, is charged to it)."""
        live = self.segments[self.current].forward_live.setdefault((self.batch, self.precision), [])
        live += [nbytes - self.saved_before for nbytes in self.memory.take()]
        self.saved_before = self.saved_total

    def _mark_backward(self, tensor: torch.Tensor | None, segment: int) -> None:
        """The backward of ``segment`` starts when the gradient of ``tensor``, its output, is complete."""
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: self._backward_window(segment, grad))

    def _backward_window(self, segment: int | None, incoming: torch.Tensor | None = None) -> None:
        """Close the running block's backward window and open ``segment``'s (None: outside the blocks), whose
        working set is measured above what is live now less the gradient it is given."""
        history = self.memory.take()
        if self.window is not None:
            index, base = self.window
            live = self.segments[index].backward_live.setdefault((self.batch, self.precision), [])
            live += [nbytes - base for nbytes in history]
        self.window = None if segment is None else (segment, self.memory.live - _nbytes(incoming))

    @contextmanager
    def _first_call_hooks(self) -> Iterator[None]:
        """Note which segment each module first ran in: its own parameters belong there (an embedding that the
        output layer reuses is the embedding's)."""

        def called(submodule: nn.Module, _args: Any) -> None:
            self.first_segment.setdefault(id(submodule), self.current)

        handles = [m.register_forward_pre_hook(called) for m in self.module.modules()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _assign_params(self) -> None:
        # hooks set the segment before a block's pre-hook, so blocks' own modules are placed by membership
        segment_of: dict[int, int] = {}
        for index, (_, block) in enumerate(self.blocks, start=1):
            for sub in block.modules():
                segment_of.setdefault(id(sub), index)
        last = len(self.segments) - 1
        tables = {
            id(p)
            for m in self.module.modules()
            if isinstance(m, nn.Embedding | nn.EmbeddingBag)
            for p in m.parameters(recurse=False)
        }
        owner = self.owner
        for m in self.module.modules():
            segment = segment_of.get(id(m), self.first_segment.get(id(m), last))
            for p in m.parameters(recurse=False):
                if id(p) not in owner or segment < owner[id(p)][0]:
                    owner[id(p)] = (segment, p.numel())
        cast = {id(p) for p in self.module.parameters() if StorageWeakRef(p.untyped_storage()) in self.cast_storages}
        for key, (segment, numel) in owner.items():
            self.segments[segment].params += numel
            self.segments[segment].table_params += numel if key in tables else 0
            self.segments[segment].cast_params += numel if key in cast and key not in tables else 0
        if len(self.segments) > 1:
            first = {key for key, (segment, _) in owner.items() if segment == 0}
            self.tied_params = sum(
                p.numel()
                for p in self.module.parameters()
                if id(p) in first and StorageWeakRef(p.untyped_storage()) in self.head_uses
            )

    def count_split(self, plan: TensorSplitPlan | None) -> tuple[list[int] | None, list[int] | None]:
        """Of each segment's parameters, how many tensor parallelism splits, and how many of those FSDP2 keeps
        whole beside it (``plan``); (None, None) for None."""
        if plan is None:
            return None, None
        return self._count_named(plan.params), self._count_named(plan.replicated_beside_fsdp)

    def _count_named(self, names: Collection[str]) -> list[int]:
        """Of each segment's parameters, how many are among ``names`` (a parameter counted where it is owned,
        as ``_assign_params`` places it)."""
        params = dict(self.module.named_parameters())
        named = {id(params[name]) for name in names if name in params}
        counts = [0] * len(self.segments)
        for key, (segment, numel) in self.owner.items():
            counts[segment] += numel if key in named else 0
        return counts

    # -- results

    def layer_profiles(
        self, split: list[int] | None = None, whole_beside_fsdp: list[int] | None = None
    ) -> tuple[LayerProfile, ...]:
        def per_sample(values: dict[tuple[int, str], float]) -> dict[str, float]:
            return {precision: _slope(values, _at(precision)) for precision in ACTIVATION_PRECISIONS}

        def fixed(values: dict[tuple[int, str], float]) -> dict[str, float]:
            # the fp32 run's, for both: the 16-bit run's constant also has autocast's 16-bit copies of the weights
            # (the planner's weight copies); the per-sequence tensors are the same (position ids are integers,
            # rotary tables and the loss's weight fp32 under autocast too)
            return dict.fromkeys(ACTIVATION_PRECISIONS, _intercept(values, lambda b: (b, "fp32")))

        def lines(live: dict[tuple[int, str], list[int]]) -> dict[str, tuple[tuple[float, float], ...]]:
            return {precision: found for precision in ACTIVATION_PRECISIONS if (found := _lines(live, precision))}

        profiles = []
        shared: dict[tuple[LayerGemm, ...], tuple[LayerGemm, ...]] = {}  # equal blocks share one tuple of products
        for index, segment in enumerate(self.segments):
            split_marked = self.marks is not None and segment.is_block
            profiles.append(
                LayerProfile(
                    name=segment.name,
                    kind=segment.kind,
                    params=segment.params,
                    table_params=segment.table_params,
                    cast_params=segment.cast_params,
                    tensor_split_params=split[index] if split is not None else None,
                    replicated_beside_fsdp_params=whole_beside_fsdp[index] if whole_beside_fsdp is not None else 0,
                    forward_flops_per_sample=_slope(segment.flops, lambda b: b),
                    activation_bytes_per_sample=per_sample(segment.saved_bytes),
                    input_bytes_per_sample=per_sample(segment.input_bytes),
                    held_bytes_per_sample=per_sample(segment.held_bytes),
                    activation_fixed_bytes=fixed(segment.saved_bytes),
                    input_fixed_bytes=fixed(segment.other_input_bytes) if segment.other_input_bytes else {},
                    tensor_split_bytes_per_sample=per_sample(segment.split_bytes) if split_marked else {},
                    gathered_bytes_per_sample=per_sample(segment.gathered_bytes) if split_marked else {},
                    forward_rise=lines(segment.forward_live),
                    backward_working=lines(segment.backward_live),
                    selective_bytes_per_sample=per_sample(segment.selective_bytes) if segment.selective_bytes else {},
                    is_block=segment.is_block,
                    gemms=shared.setdefault(gemms := gemms_per_sample(segment.gemms, BATCHES), gemms),
                )
            )
        return tuple(profiles)
