"""The kernels a GPU runs, on a fake CPU trace, and the FLOPs of those PyTorch's counter does not know.

A trace runs on the CPU, where PyTorch picks other kernels than on a GPU for attention (a math fallback that
saves the s x s probabilities) and for Hugging Face's mixture-of-experts layers (a ``grouped_mm`` whose fake
kernel takes bf16 only). The modes here send those calls to kernels that save what a GPU's save and run on
fake tensors, and ``flop_formulas`` gives ``FlopCounterMode`` their FLOPs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter

from redline.workload.profile import LayerGemm


def flop_formulas() -> dict[Any, Any]:
    """FLOP formulas PyTorch lacks: its CPU flash attention, which the fake run takes where a GPU takes another
    fused kernel (the same arithmetic), and transformers' grouped matmul for mixture-of-experts layers."""
    aten = torch.ops.aten
    formulas = {}
    for op, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", "sdpa_flop"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "sdpa_backward_flop"),
    ):
        if hasattr(aten, op) and hasattr(flop_counter, formula):
            formulas[getattr(aten, op)] = _as_raw(getattr(flop_counter, formula))
    # transformers' grouped matmul of mixture-of-experts layers (see traceable_experts), where it is registered
    with suppress(AttributeError, RuntimeError):
        formulas[torch.ops.transformers.grouped_mm_fallback] = _grouped_mm_flop
        formulas[torch.ops.transformers.grouped_mm_fallback_backward] = _grouped_mm_backward_flop
    return formulas


# what a recorder is told of each matrix product: (products, M, N, K, attention core)
GemmRecorder = Callable[[int, int, int, int, bool], None]


def recording_formulas(record: GemmRecorder) -> dict[Any, Any]:
    """``flop_formulas`` plus, for each matrix product the counter sees (mm, addmm, bmm, baddbmm and the fused
    attention's two products), a formula that tells ``record`` its shape before it counts its FLOPs: the planner
    times each product by its shape (``plan.gemm``)."""
    aten = torch.ops.aten
    formulas = flop_formulas()

    def last_two(a: Any, b: Any) -> list[tuple[int, int, int, int, bool]]:  # (.., M, K) @ (.., K, N)
        return [(math.prod(a.shape[:-2]), a.shape[-2], b.shape[-1], a.shape[-1], False)]

    products: dict[Any, Callable[..., list[tuple[int, int, int, int, bool]]]] = {
        aten.mm: last_two,
        aten.bmm: last_two,
        aten.addmm: lambda _bias, a, b, *_rest: last_two(a, b),
        aten.baddbmm: lambda _bias, a, b, *_rest: last_two(a, b),
    }
    fused = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused is not None and fused in formulas:
        products[fused] = _attention_products
    for op, shapes in products.items():
        formulas[op] = _recording(formulas.get(op) or flop_counter.flop_registry[op], shapes, record)
    return formulas


def gemms_per_sample(
    recorded: dict[int, list[tuple[int, int, int, int, bool]]], batches: tuple[int, int]
) -> tuple[LayerGemm, ...]:
    """A segment's products for one sample, from those recorded at two batch sizes in the same order: a product
    whose M grows with the batch is a linear layer's (M per sample: the sample's tokens), one whose count grows a
    batched one's (count per sample: its heads). Tensor parallelism is taken to split a linear layer's larger side
    (a column-parallel layer widens, a row-parallel one narrows) and a batched product's heads. Products that do
    not grow with the batch, or runs that differ in their products, are left out: the planner then times their
    FLOPs at the large-GEMM rate."""
    small, large = (recorded.get(b, []) for b in batches)
    if len(small) != len(large):
        return ()
    ratio = batches[1] // batches[0]
    gemms = []
    for (c1, m1, n1, k1, core), (c2, m2, n2, k2, _) in zip(small, large, strict=True):
        if (n1, k1) != (n2, k2):
            continue
        if c1 == c2 and m2 == ratio * m1 and m1 % batches[0] == 0:
            widens = n1 >= k1
            gemms.append(
                LayerGemm(m1 // batches[0], n1, k1, c1, tensor_split="cols" if widens else "inner", attention_core=core)
            )
        elif m1 == m2 and c2 == ratio * c1 and c1 % batches[0] == 0:
            gemms.append(LayerGemm(m1, n1, k1, c1 // batches[0], True, "count", core))
    return tuple(gemms)


def _attention_products(query: Any, key: Any, value: Any, *_rest: Any, **_kwargs: Any) -> list[Any]:
    """Fused attention over (batch, heads, sequence, head dim) tensors: Q K^T and the scores times V per head."""
    heads = math.prod(query.shape[:-2])
    s_q, s_k, d, d_v = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    return [(heads, s_q, s_k, d, True), (heads, s_q, d_v, s_k, True)]


def _recording(
    formula: Callable[..., int], shapes: Callable[..., list[tuple[int, int, int, int, bool]]], record: GemmRecorder
) -> Callable[..., int]:
    def raw(*args: Any, **kwargs: Any) -> int:
        for product in shapes(*args):
            record(*product)
        return formula(*args, **kwargs)

    raw._get_raw = True  # type: ignore[attr-defined]
    return raw


def _as_raw(formula: Callable[..., int]) -> Callable[..., int]:
    """PyTorch's registered formulas already turn tensors into shapes; mark them so they are not wrapped twice."""

    def raw(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    raw._get_raw = True  # type: ignore[attr-defined]
    return raw


def _grouped_mm_flop(input_shape: Any, weight_shape: Any, *_args: Any, **_kwargs: Any) -> int:
    """Each of S rows times its expert's k x n matrix: 2 S k n (the experts' weights are E x k x n)."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[2]


def _grouped_mm_backward_flop(input_shape: Any, weight_shape: Any, *_args: Any, **_kwargs: Any) -> int:
    """The input's gradient and the weights', each as many FLOPs as the forward."""
    return 2 * _grouped_mm_flop(input_shape, weight_shape)


@contextmanager
def traceable_experts() -> Iterator[None]:
    """Hugging Face's mixture-of-experts layers multiply through ``grouped_mm``, whose fake kernel takes bf16
    only (their eager alternative asks for data-dependent shapes): while tracing, they take transformers' own
    fallback operator, the same arithmetic with a fake kernel of its own. Nothing changes for other models."""
    moe: Any = sys.modules.get("transformers.integrations.moe")  # imported by the model's own module, if any
    if moe is None or not hasattr(moe, "_can_use_grouped_mm"):
        yield
        return
    chooser = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *_args, **_kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = chooser


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool], dict[str, Any]]:
    """F.scaled_dot_product_attention's signature, to read its arguments however they were passed."""
    del enable_gqa  # the fused kernel's fake implementation takes fewer key/value heads as they come
    return (query, key, value, dropout_p, is_causal), {"attn_mask": attn_mask, "scale": scale}


class FusedAttention(TorchFunctionMode):
    """Run ``F.scaled_dot_product_attention`` as a fused kernel, as it runs on a GPU.

    On a CPU, PyTorch takes its math fallback whenever dropout is on, and that fallback upcasts 16-bit inputs to
    fp32 and saves the s x s attention probabilities and dropout mask for the backward pass: activations a GPU
    never holds (its flash and memory-efficient kernels keep the output and a log-sum-exp). Sending the call to
    the CPU flash kernel, whose fake implementation needs no values, saves what a GPU saves; under autocast its
    inputs are cast to 16 bits first, as CUDA's autocast does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0  # attention calls sent to the fused kernel

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        fused_args, fused_kwargs = _sdpa_arguments(*args, **kwargs)
        query, key, value = fused_args[:3]
        if any(t.dim() != 4 for t in (query, key, value)):
            return func(*args, **kwargs)
        self.calls += 1
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            fused_args = (query.to(dtype), key.to(dtype), value.to(dtype), *fused_args[3:])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*fused_args, **fused_kwargs)[0]


def fused_attention() -> Any:
    """The mode above where this PyTorch has the fused CPU kernel; otherwise nothing changes."""
    fused = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return FusedAttention() if fused else nullcontext()
