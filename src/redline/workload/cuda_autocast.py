"""CUDA's autocast policy for a trace that runs on the CPU.

The tracer measures 16-bit activations under ``torch.autocast("cpu", torch.bfloat16)``, but the planner
predicts a GPU, and the two autocasts differ. Both run matmuls and convolutions in 16 bits; CUDA's also
runs a list of numerically touchy ops in fp32 (``pow``, ``exp``, ``softmax``, ``layer_norm``, ``sum``, ...),
where CPU's leaves them in their input's 16-bit type. Their outputs are then 4 bytes a value and so is what
their backward saves, and what follows them promotes to fp32 too. Hugging Face GPT-2's tanh GELU
(``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))``) saves 16 bytes per value on a GPU and 10 on the CPU:
about 20% of that model's activations.

CUDA's autocast also promotes the floating arguments of a few ops to the widest type among them (``index_put``,
``scatter_add``, ``dot``, ...), ops that refuse mixed types otherwise: under CPU autocast a model that, say,
scatters 16-bit expert outputs into an fp32 buffer does not run at all.

``cuda_autocast_policy()`` registers, for as long as it is entered, a kernel under the ``AutocastCPU``
dispatch key for each such op CPU's autocast does not touch. As CUDA's kernels do, it casts the op's
fp16/bf16 tensor arguments to fp32 (or for the ops that take a ``dtype`` and were given none, asks for an
fp32 result instead), or promotes them to the widest, then runs the op below autocast. It sits above
autograd, as autocast does, so the cast is recorded and the backward saves what it saves on a GPU. The
registration is process-wide (CPU autocast in another thread sees it too); nested and concurrent entries
share one.

The lists are ATen's (``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_PROMOTE``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

# CUDA autocast casts these to fp32 (overload names as in ATen's schema)
FP32_OPS = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "dist",
    "pdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
)
# ... and these compute in fp32 (``dtype=float32``) when no dtype is given
FP32_UNLESS_DTYPE_OPS = (
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
# ... and these take their floating arguments in the widest type among them
PROMOTE_OPS = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)
_LOWER_PRECISION = (torch.float16, torch.bfloat16)
_BELOW_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOWER_PRECISION:
        return value.float()
    return value


def _fp32_kernel(op: torch._ops.OpOverload, unless_dtype: bool) -> Callable[..., Any]:
    names = [argument.name for argument in op._schema.arguments]
    dtype_at = names.index("dtype") if unless_dtype and "dtype" in names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOCAST):
            if dtype_at is None:
                args, kwargs = tree_map(_to_fp32, (args, kwargs))
            elif kwargs.get("dtype", args[dtype_at] if dtype_at < len(args) else None) is None:
                lower = any(isinstance(a, torch.Tensor) and a.dtype in _LOWER_PRECISION for a in args)
                if lower and dtype_at < len(args):
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                elif lower:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _promotable(value: Any) -> bool:
    """A floating tensor autocast may cast: float64 is left alone (and does not take part), as CUDA leaves it."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _promote_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOCAST):
            floating = [t.dtype for t in tree_leaves((args, kwargs)) if _promotable(t)]
            if floating:
                widest = functools.reduce(torch.promote_types, floating)
                args, kwargs = tree_map(lambda t: t.to(widest) if _promotable(t) else t, (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _overload(qualified: str) -> torch._ops.OpOverload | None:
    name, _, overload = qualified.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


def _register() -> tuple[Any, int]:
    library = torch.library.Library("aten", "IMPL")
    changed = 0
    policies: tuple[tuple[tuple[str, ...], Callable[[torch._ops.OpOverload], Callable[..., Any]]], ...] = (
        (FP32_OPS, lambda op: _fp32_kernel(op, unless_dtype=False)),
        (FP32_UNLESS_DTYPE_OPS, lambda op: _fp32_kernel(op, unless_dtype=True)),
        (PROMOTE_OPS, _promote_kernel),
    )
    for names, make_kernel in policies:
        for qualified in names:
            op = _overload(qualified)
            if op is None or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "AutocastCPU"):
                continue
            library.impl(qualified, make_kernel(op), "AutocastCPU")
            changed += 1
    return library, changed


_lock = threading.Lock()
_entered = 0
_registration: tuple[Any, int] | None = None


@contextmanager
def cuda_autocast_policy() -> Iterator[int]:
    """While entered, CPU autocast runs CUDA's fp32 ops in fp32 and promotes its promote ops' arguments as CUDA's
    does; yields how many ops were changed. Ops this PyTorch lacks, or that CPU autocast already handles, are
    left alone."""
    global _entered, _registration
    with _lock:
        if _registration is None:
            _registration = _register()
        _entered += 1
        changed = _registration[1]
    try:
        yield changed
    finally:
        with _lock:
            _entered -= 1
            if _entered == 0 and _registration is not None:
                _registration[0]._destroy()
                _registration = None
