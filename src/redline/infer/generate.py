"""A decoder's generation, timed in its two phases, with a static KV cache, eager and compiled.

Prefill runs the prompt through the model once, filling the cache (compute-bound: many tokens per weight
read); decode then adds one token per call (bound by reading the weights and the cache). A static cache
(transformers' ``StaticCache``: fixed-size key/value buffers written at ``cache_position``) keeps every decode
call the same shape, which is what lets ``torch.compile`` compile the decode step once instead of per length.
Tokens are greedy (arg-max), so eager and compiled must produce the same ones; ``agreement`` is the share that do.
The prefill runs eager in both modes (``COMPILED`` says what each compiles), so it is one figure for both.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from typing import Any

import torch

from redline.errors import one_line
from redline.infer.models import Subject

MODES = ("eager", "compile")


# what each mode compiles: prefill runs eager in both (the static cache's buffers are made by its first call,
# outside any graph, as transformers documents), so the modes differ in the decode step only
COMPILED = {"eager": "nothing", "compile": "decode step"}


@dataclasses.dataclass
class GenerationRow:
    mode: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    status: str = "ok"  # ok | failed
    note: str = ""
    compiled: str = ""  # what torch.compile compiled in this mode (COMPILED)
    cold_s: float | None = None  # the first generation (compiles the decode step)
    # eager in both modes, so one figure: the median prefill of every timed generation, both modes' alike
    prefill_ms: float | None = None
    decode_tokens_per_s: float | None = None  # new tokens x batch per second of decode, at the median generation
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
    subject: Subject, batch: int, prompt_tokens: int, new_tokens: int, device: str, repeats: int = 5
) -> tuple[list[GenerationRow], torch.Tensor | None]:
    """Eager and compiled generation of ``new_tokens`` after a ``prompt_tokens`` prompt: a first (cold) generation
    in each mode, then ``repeats`` rounds of one generation in each mode, interleaved as ``measure`` interleaves
    the backends, so that a neighbour's load falls on both modes alike; the medians of those; and eager's tokens
    (None where eager failed).

    The prefill runs eager in both modes and only the decode step is compiled, as transformers documents for its
    static cache: the cache's buffers are made (and marked static) by the first call, outside the graph. One
    prefill figure, over both modes' generations, says so: the same code timed twice would only show noise."""
    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, not {repeats}")
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

    torch.compiler.reset()  # the measured backends' graphs go: this compile is the decode step's own
    decoders = {"eager": eager, "compile": torch.compile(eager, dynamic=False)}
    rows = {mode: GenerationRow(mode, batch, prompt_tokens, new_tokens, compiled=COMPILED[mode]) for mode in MODES}

    def run(mode: str) -> tuple[float, float, torch.Tensor] | None:
        """One generation in ``mode``; None, and the row failed, where it raised."""
        try:
            return _generate(model, eager, decoders[mode], ids, new_tokens, device, positions)
        except Exception as exc:  # a model whose cache or graph does not compile is a result, not a crash
            rows[mode].status, rows[mode].note = "failed", f"{one_line(exc)}"
            return None

    tokens: dict[str, torch.Tensor] = {}
    for mode, row in rows.items():
        start = time.perf_counter()
        if (cold := run(mode)) is not None:
            row.cold_s = time.perf_counter() - start
            tokens[mode] = cold[2]
    timed: dict[str, list[tuple[float, float, torch.Tensor]]] = {mode: [] for mode in tokens}
    for _ in range(repeats):
        for mode in [m for m in timed if rows[m].status == "ok"]:
            if (result := run(mode)) is not None:
                timed[mode].append(result)
    _summarise(rows, timed, tokens, batch, new_tokens)
    return list(rows.values()), tokens.get("eager")


def _summarise(
    rows: dict[str, GenerationRow],
    timed: dict[str, list[tuple[float, float, torch.Tensor]]],
    tokens: dict[str, torch.Tensor],
    batch: int,
    new_tokens: int,
) -> None:
    """The rows' figures from their timed generations: one prefill over both modes (eager code in both), each
    mode's median decode, and each mode's share of eager's tokens."""
    prefills = [prefill_s for mode, runs in timed.items() if rows[mode].status == "ok" for prefill_s, _, _ in runs]
    for mode, row in rows.items():
        if row.status != "ok":
            continue
        row.prefill_ms = statistics.median(prefills) * 1e3
        decode_s = statistics.median(decode for _, decode, _ in timed[mode])
        row.decode_tokens_per_s = batch * (new_tokens - 1) / decode_s if new_tokens > 1 else None
        if "eager" in tokens:
            row.agreement = float((tokens[mode] == tokens["eager"]).float().mean())
