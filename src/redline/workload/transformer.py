"""Analytic parameter, FLOP and activation counts for transformers, each from its published formula.

Notation follows Megatron-LM and Korthikanti et al.: s sequence length, h hidden size, a attention heads,
G key/value groups, q query width (a x head_dim), f MLP width, V vocabulary, L layers, t tensor-parallel
degree. Counts are per sample (one sequence); multiply by the micro-batch b.
"""

from __future__ import annotations

from redline.workload.profile import LayerGemm, LayerProfile, TransformerShape, WorkloadProfile

# -------------------------------------------------------------------------------------------- params


def _attention_params(shape: TransformerShape, *, cross: bool = False) -> int:
    """Q and O are h x q; K and V are h x (G * head_dim), or h x q for cross-attention (as T5 does)."""
    h, q = shape.hidden, shape.query_width
    kv = q if cross else shape.groups * shape.dim_per_head
    weights = 2 * h * q + 2 * h * kv
    biases = (q + 2 * kv + h) if shape.bias else 0
    return weights + biases


def _mlp_params(shape: TransformerShape) -> int:
    h, f = shape.hidden, shape.ffn_hidden
    matrices = 3 if shape.gated_mlp else 2
    biases = ((2 if shape.gated_mlp else 1) * f + h) if shape.bias else 0
    return matrices * h * f + biases


def _norm_params(shape: TransformerShape) -> int:
    return 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden


def block_params(shape: TransformerShape, *, decoder: bool = False) -> int:
    """One transformer block: attention, MLP and two norms (plus cross-attention and a third norm in an
    encoder-decoder's decoder block)."""
    total = _attention_params(shape) + _mlp_params(shape) + 2 * _norm_params(shape)
    if decoder:
        total += _attention_params(shape, cross=True) + _norm_params(shape)
    return total


def embedding_params(shape: TransformerShape) -> int:
    return (shape.vocab + shape.position_embeddings) * shape.hidden


def head_params(shape: TransformerShape) -> int:
    """Final norm(s) and, unless tied to the embedding, the output projection."""
    final_norms = (2 if shape.decoder_layers else 1) if shape.final_norm else 0  # one per stack
    untied_head = 0 if shape.tied_embeddings or not shape.lm_head else shape.vocab * shape.hidden
    return final_norms * _norm_params(shape) + untied_head


def count_params(shape: TransformerShape) -> int:
    """Exact parameter count of a standard implementation (Hugging Face's GPT-2, Llama, BERT, T5)."""
    encoder = shape.layers - shape.decoder_layers
    blocks = encoder * block_params(shape) + shape.decoder_layers * block_params(shape, decoder=True)
    return embedding_params(shape) + blocks + head_params(shape) + shape.extra_params


def largest_module_params(shape: TransformerShape) -> int:
    """DeepSpeed's LL: the largest single module is the embedding (or an untied head of the same size)
    in every transformer of interest; a decoder MLP matrix would be h x f."""
    return max(shape.vocab * shape.hidden, shape.hidden * shape.ffn_hidden)


# --------------------------------------------------------------------------------------------- FLOPs


def block_forward_flops(shape: TransformerShape, seq_len: int, *, decoder: bool = False) -> float:
    """Forward FLOPs of one block for one sequence: 2 per multiply-accumulate of every matmul.

    Per layer (Megatron-LM ``num_floating_point_operations`` divided by 3 for the forward pass alone):
    projections 2sh(2q + 2Gd), attention scores and values 4s^2 q (counted in full, causal or not, as
    Megatron and Narayanan et al. do), MLP 2shf x (3 if gated else 2).
    """
    s, h, q, f = seq_len, shape.hidden, shape.query_width, shape.ffn_hidden
    kv = shape.groups * shape.dim_per_head
    flops = 2 * s * h * (2 * q + 2 * kv)
    flops += 2 * s * h * f * (3 if shape.gated_mlp else 2)
    if decoder:  # cross-attention over an encoder output of the same length
        flops += 2 * s * h * 4 * q
    return flops + attention_core_flops(shape, seq_len, decoder=decoder)


def block_gemms(shape: TransformerShape, seq_len: int, *, decoder: bool = False) -> tuple[LayerGemm, ...]:
    """The matrix products of one block's forward pass for one sequence, as Megatron-LM lays them out and splits
    them over t ranks: the fused QKV projection and the MLP's up (and gate) projection column-wise, the attention
    output and MLP down projection row-wise, the attention core by heads. Their FLOPs are
    ``block_forward_flops``'s."""
    s, h, q, f, d = seq_len, shape.hidden, shape.query_width, shape.ffn_hidden, shape.dim_per_head
    kv = shape.groups * d
    up = 2 * f if shape.gated_mlp else f  # gate and up as one column-parallel product (Megatron's fused SwiGLU)
    core = (
        LayerGemm(s, s, d, shape.heads, batched=True, tensor_split="count", attention_core=True),  # Q K^T
        LayerGemm(s, d, s, shape.heads, batched=True, tensor_split="count", attention_core=True),  # scores @ V
    )
    gemms = [LayerGemm(s, q + 2 * kv, h), *core, LayerGemm(s, h, q, tensor_split="inner")]
    if decoder:  # cross-attention: its own Q, K, V and output over an encoder output of the same length
        gemms += [LayerGemm(s, 3 * q, h), *core, LayerGemm(s, h, q, tensor_split="inner")]
    gemms += [LayerGemm(s, up, h), LayerGemm(s, h, f, tensor_split="inner")]
    return tuple(gemms)


def attention_core_flops(shape: TransformerShape, seq_len: int, *, decoder: bool = False) -> float:
    """Forward FLOPs of one block's attention core for one sequence, QK^T and the attention over V: 4 s^2 q
    (twice in a decoder block, with its cross-attention). What selective checkpointing recomputes."""
    return float(4 * seq_len * seq_len * shape.query_width * (2 if decoder else 1))


def logits_forward_flops(shape: TransformerShape, seq_len: int) -> float:
    """The output projection onto the vocabulary, 2sVh (the V/(2Lh) term of Megatron's formula)."""
    return float(2 * seq_len * shape.hidden * shape.vocab) if shape.lm_head else 0.0


def forward_flops(shape: TransformerShape, seq_len: int | None = None) -> float:
    s = seq_len or shape.seq_len
    encoder = shape.layers - shape.decoder_layers
    blocks = encoder * block_forward_flops(shape, s) + shape.decoder_layers * block_forward_flops(
        shape, s, decoder=True
    )
    return blocks + logits_forward_flops(shape, s)


def narayanan_step_flops(
    batch: int, seq_len: int, layers: int, hidden: int, vocab: int, *, recompute: bool = False
) -> float:
    """FLOPs of one training step of a dense GPT (Narayanan et al. 2021, appendix A):
    72 B s L h^2 (1 + s/6h + V/12Lh) without activation recomputation, 96 B s L h^2 (1 + s/6h + V/16Lh)
    with full recomputation (one more forward pass of the blocks)."""
    b, s, n_layers, h, v = batch, seq_len, layers, hidden, vocab
    if recompute:
        return 96 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))
    return 72 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (12 * n_layers * h))


# ---------------------------------------------------------------------------------------- activations


def block_activation_bytes(
    shape: TransformerShape,
    seq_len: int,
    *,
    bytes_per_value: int = 2,
    norm_input_bytes: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    flash_attention: bool = True,
    selective_recompute: bool = False,
    decoder: bool = False,
) -> float:
    """Bytes one block saves for its backward pass, per sequence (Korthikanti et al. 2022, section 4).

    With 16-bit values, multi-head attention, f = 4h, dropout and no flash attention this is the paper's
    ``sbh(34 + 5as/h)``, and with tensor parallelism ``sbh(10 + 24/t + 5as/(ht))``; sequence parallelism
    divides everything by t. The pieces, in units of s*h values:

    - replicated under TP without SP: two norm inputs, the attention and MLP inputs (4 values), plus the
      two 1-byte dropout masks;
    - split by t: Q, K, V, the attention output (projection input), the MLP's inner activations (2 per
      f-wide tensor, 4 when gated: gate, up, act(gate) and their product; 3 when one fused kernel computes
      act(gate) * up, as Megatron's SwiGLU does: it keeps its input, gate and up, and the product);
    - the s x s attention core, 5as^2 bytes at 16 bits (softmax output, its dropout mask and output),
      which flash attention replaces by a log-sum-exp of a*s fp32 values and selective recompute drops.

    ``bytes_per_value`` is 2 for fp16/bf16 activations, 4 for fp32; masks stay one byte.
    ``norm_input_bytes`` (default: ``bytes_per_value``) is 4 under PyTorch autocast, which keeps the
    residual stream, and so what each norm saves, in fp32 (Megatron's bf16 residual is the paper's case).
    """
    s, h, a, q, f = seq_len, shape.hidden, shape.heads, shape.query_width, shape.ffn_hidden
    t = tensor_parallel
    kv = shape.groups * shape.dim_per_head
    value = bytes_per_value
    mask = 1 if shape.dropout else 0

    norm = norm_input_bytes or value
    replicated = (2 * norm + 2 * value) * s * h + mask * 2 * s * h  # 2 norm inputs, attention and MLP inputs, masks
    split = value * s * (q + 2 * kv + q)  # Q, K, V, attention output
    split += value * s * f * _mlp_inner_tensors(shape)
    if flash_attention:
        core = 4 * a * s  # fp32 log-sum-exp per head and position
    elif selective_recompute:
        core = 0
    else:
        core = (2 * value + mask) * a * s * s  # softmax output, dropout output, dropout mask
    split += core
    if decoder:  # cross-attention: its norm input, Q, K, V of the encoder output, output, mask
        replicated += norm * s * h + mask * s * h
        split += value * s * 4 * q + core
    if sequence_parallel:
        return (replicated + split) / t
    return replicated + split / t


def _mlp_inner_tensors(shape: TransformerShape) -> int:
    """How many f-wide tensors the MLP saves: its activation's input and output (2), or, gated, the gate, the up
    projection, act(gate) and the product (4), of which a fused act(gate) * up kernel recomputes act(gate) (3)."""
    if not shape.gated_mlp:
        return 2
    return 3 if shape.fused_gated_activation else 4


def logits_activation_bytes(
    shape: TransformerShape,
    seq_len: int,
    *,
    tensor_parallel: int = 1,
    fused_cross_entropy: bool = True,
    bytes_per_value: int = 2,
) -> float:
    """Final norm input and what the cross-entropy keeps, all divided by t.

    Megatron's fused vocab-parallel cross-entropy keeps the fp32 logits: 4sh(1 + V/h) (Megatron-LM
    ``theoretical_memory_usage.py``, last pipeline stage). PyTorch's ``F.cross_entropy`` on logits upcast
    to fp32, as Hugging Face models call it, keeps the logits in the compute precision and the fp32
    log-softmax it saves: 4sh + (bytes_per_value + 4)sV (``fused_cross_entropy=False``).
    """
    if not shape.lm_head:
        return 0.0
    s, h, v = seq_len, shape.hidden, shape.vocab
    if fused_cross_entropy:
        return 4 * s * h * (1 + v / h) / tensor_parallel
    return (4 * s * h + (bytes_per_value + 4) * s * v) / tensor_parallel


def block_input_bytes(shape: TransformerShape, seq_len: int, *, bytes_per_value: int) -> float:
    """What full activation checkpointing keeps per block: its input, s x h values (4 bytes each for PyTorch's
    fp32 residual stream, under autocast too; 2 in Megatron's bf16 one)."""
    return float(bytes_per_value * seq_len * shape.hidden)


# ----------------------------------------------------------------------------------------- profile


def transformer_profile(shape: TransformerShape, *, name: str, source: str) -> WorkloadProfile:
    """A profile from the formulas above at the shape's sequence length (flash attention assumed: PyTorch's
    ``scaled_dot_product_attention``, which Hugging Face models use by default, does not save s x s)."""
    s = shape.seq_len
    encoder = shape.layers - shape.decoder_layers
    stream = shape.residual_bytes or 4  # the 16-bit figures' residual stream: fp32 as autocast alone keeps it
    mask_bytes = float(s * shape.hidden) if shape.dropout else 0.0  # embedding dropout keeps a 1-byte mask
    # one tuple per kind of block, shared by every block of that kind (the planner times each tuple once)
    gemms = {decoder: block_gemms(shape, s, decoder=decoder) for decoder in (False, True)}
    layers: list[LayerProfile] = [
        LayerProfile(
            name="embedding",
            kind="embedding",
            params=embedding_params(shape) + shape.extra_params,
            table_params=embedding_params(shape),
            forward_flops_per_sample=0.0,
            activation_bytes_per_sample={"16bit": mask_bytes, "fp32": mask_bytes},
            is_block=False,
        )
    ]
    for index in range(shape.layers):
        decoder = index >= encoder
        layers.append(
            LayerProfile(
                name=f"layers.{index}",
                kind="decoder block" if decoder and shape.decoder_layers else "block",
                params=block_params(shape, decoder=decoder),
                forward_flops_per_sample=block_forward_flops(shape, s, decoder=decoder),
                gemms=gemms[decoder],
                activation_bytes_per_sample={
                    # autocast alone keeps an fp32 residual stream, so 4-byte norm inputs; Megatron a bf16 one (the
                    # planner corrects for the stream its strategy keeps: plan.dtypes)
                    "16bit": block_activation_bytes(shape, s, norm_input_bytes=stream, decoder=decoder),
                    "fp32": block_activation_bytes(shape, s, bytes_per_value=4, decoder=decoder),
                },
                # the residual stream: fp32 under autocast too, bf16 in Megatron's 16-bit steps
                input_bytes_per_sample={
                    "16bit": block_input_bytes(shape, s, bytes_per_value=stream),
                    "fp32": block_input_bytes(shape, s, bytes_per_value=4),
                },
            )
        )
    # as PyTorch computes the loss: F.cross_entropy on fp32-upcast logits
    logits_16 = logits_activation_bytes(shape, s, fused_cross_entropy=False, bytes_per_value=2)
    logits_32 = logits_activation_bytes(shape, s, fused_cross_entropy=False, bytes_per_value=4)
    layers.append(
        LayerProfile(
            name="head",
            kind="lm head" if shape.lm_head else "final norm",
            params=head_params(shape),
            forward_flops_per_sample=logits_forward_flops(shape, s),
            # the output projection, vocabulary-parallel (Megatron): each rank computes V/t of the logits
            gemms=(LayerGemm(s, shape.vocab, shape.hidden),) if shape.lm_head else (),
            activation_bytes_per_sample={"16bit": logits_16, "fp32": logits_32},
            # the logits, which the training loop holds through the backward
            held_bytes_per_sample={"16bit": 2.0 * s * shape.vocab, "fp32": 4.0 * s * shape.vocab}
            if shape.lm_head
            else {},
            is_block=False,
        )
    )
    params = count_params(shape)
    return WorkloadProfile(
        name=name,
        source=source,
        method="analytic",
        params_total=params,
        params_trainable=params,
        largest_module_params=largest_module_params(shape),
        forward_flops_per_sample=forward_flops(shape),
        layers=tuple(layers),
        tokens_per_sample=s,
        sample_unit="sequence",
        transformer=shape,
        loss_vocab=shape.vocab if shape.lm_head else None,
        tied_params=shape.vocab * shape.hidden if shape.lm_head and shape.tied_embeddings else 0,
    )
