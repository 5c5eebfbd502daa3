"""A decoder's generation, timed in its two phases, with a static KV cache, eager and compiled.

Prefill runs the prompt through the model once, filling the cache (compute-bound: many tokens per weight
read); decode then adds one token per call (bound by reading the weights and the cache). A static cache
(transformers' ``StaticCache``: fixed-size key/value buffers written at ``cache_position``) keeps every decode
call the same shape, which is what lets ``torch.compile`` compile the decode step once instead of per length.
Tokens are greedy (arg-max), so eager and compiled must produce the same ones; ``agreement`` is the share that do.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any

import torch

from redline.errors import one_line
from redline.infer.models import Subject

MODES = ("eager", "compile")


@dataclasses.dataclass
class GenerationRow:
    mode: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    status: str = "ok"  # ok | failed
    note: str = ""
    cold_s: float | None = None  # the first generation (compiles the decode step)
    prefill_ms: float | None = None  # eager in both modes
    decode_tokens_per_s: float | None = None  # new tokens x batch per second of decode
    agreement: float | None = None  # of the tokens, the share equal to eager's


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate(
    model: Any, prefill: Any, decode: Any, ids: torch.Tensor, new_tokens: int, device: str, positions: bool
) -> tuple[float, float, Any]:
    """One greedy generation: prefill and decode seconds, and the tokens. ``positions``: the model wants the
    cache positions written given (a tensor, so that a compiled step does not specialise on each one)."""
    from transformers import StaticCache

    prompt = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=prompt + new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        where = torch.arange(prompt, device=device) if positions else None
        token = prefill(ids, cache, where)[:, -1:].argmax(-1)
        _sync(device)
        prefill_s = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for step in range(new_tokens - 1):
            where = torch.tensor([prompt + step], device=device) if positions else None
            token = decode(token, cache, where)[:, -1:].argmax(-1)
            tokens.append(token)
        _sync(device)
        decode_s = time.perf_counter() - start
    return prefill_s, decode_s, torch.cat(tokens, dim=1).cpu()


def generation(
    subject: Subject, batch: int, prompt_tokens: int, new_tokens: int, device: str, repeats: int = 3
) -> tuple[list[GenerationRow], torch.Tensor | None]:
    """Eager and compiled generation of ``new_tokens`` after a ``prompt_tokens`` prompt: the best of ``repeats``
    generations after a first (cold) one; and eager's tokens (None where eager failed).

    The prefill runs eager in both modes and only the decode step is compiled, as transformers documents for its
    static cache: the cache's buffers are made (and marked static) by the first call, outside the graph."""
    model = subject.served.inner.to(device)
    ids = subject.example(batch)[:, :prompt_tokens].to(device)
    if ids.shape[1] < prompt_tokens:
        ids = torch.randint(0, subject.vocab or 2, (batch, prompt_tokens), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)

    # transformers 5 takes the cache as ``cache`` and finds the positions in it; 4.x as ``past_key_values``, with
    # the positions written given as ``cache_position``
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    positions = "cache_position" in params

    def eager(tokens: torch.Tensor, cache: Any, where: torch.Tensor | None) -> torch.Tensor:
        extra = {} if where is None else {"cache_position": where}
        return model(input_ids=tokens, use_cache=True, **{cache_arg: cache}, **extra).logits

    rows: list[GenerationRow] = []
    reference = None
    for mode in MODES:
        row = GenerationRow(mode, batch, prompt_tokens, new_tokens)
        torch.compiler.reset()
        decode = eager if mode == "eager" else torch.compile(eager, dynamic=False)
        try:
            start = time.perf_counter()
            _, _, tokens = _generate(model, eager, decode, ids, new_tokens, device, positions)
            row.cold_s = time.perf_counter() - start
            runs = [_generate(model, eager, decode, ids, new_tokens, device, positions) for _ in range(repeats)]
        except Exception as exc:  # a model whose cache or graph does not compile is a result, not a crash
            row.status, row.note = "failed", f"{one_line(exc)}"
            rows.append(row)
            continue
        row.prefill_ms = min(r[0] for r in runs) * 1e3
        decode_s = min(r[1] for r in runs)
        row.decode_tokens_per_s = batch * (new_tokens - 1) / decode_s if new_tokens > 1 else None
        if mode == "eager":
            reference = tokens
        if reference is not None:
            row.agreement = float((tokens == reference).float().mean())
        rows.append(row)
    return rows, reference
