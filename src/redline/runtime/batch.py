"""A batch of any shape the user's loader yields: split into micro-batches and moved to the device.

A batch is a tree: tensors, numbers and strings at the leaves; tuples, lists, mappings (a dict, Hugging Face's
``BatchEncoding``, any ``Mapping``) and dataclasses above them. Its batch size is known (the loader's per-rank
batch), and splitting cuts every field that has that many entries: a tensor whose first dimension is the batch
size, and a list or tuple of one entry per sample (strings, per-sample tensors of any shape as detection
collators make them, per-sample dicts). A list whose entries are batched tensors (``default_collate`` makes
one of ``(x, y)`` samples) is a list of fields. Anything else (a 0-dim tensor, a tensor shared by every sample,
a config string) goes to every micro-batch as it is.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from redline.errors import BadInput


def split(batch: Any, parts: int, size: int, *, uneven: bool = False) -> list[Any]:
    """``parts`` micro-batches of ``size // parts`` samples each; BadInput when they do not divide (unless
    ``uneven``: then sizes differ by one at most, see ``bounds``), or when no field of the batch has ``size``
    entries (nothing to split: every micro-batch would train on all of it)."""
    if parts == 1:
        return [batch]
    if size % parts and not uneven:
        raise BadInput(f"a batch of {size} samples does not split into {parts} micro-batches")
    if not _has_batch_dim(batch, size):
        raise BadInput(
            f"no field of the {type(batch).__name__} batch has {size} entries (the batch size) to split into {parts} "
            "micro-batches: yield tensors with the batch first, or plan without accumulation"
        )
    edges = bounds(size, parts)
    return [_take(batch, size, start, stop) for start, stop in itertools.pairwise(edges)]


def bounds(size: int, parts: int) -> list[int]:
    """Where ``parts`` micro-batches of a batch of ``size`` start and end, as even as they can be (at most
    ``size`` parts: none is empty)."""
    parts = min(parts, size)
    return [size * i // parts for i in range(parts + 1)]


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of the batch on ``device``; asynchronous from pinned memory (a pageable copy cannot be)."""
    return _map(batch, lambda t: t.to(device, non_blocking=t.is_pinned()))


def tokens_per_sample(batch: Any) -> int:
    """Tokens in each sample of a language model's batch: the sequence length of its ``input_ids``, else of
    its first 2-D integer tensor (token ids, batch first); 1 for a batch without one (images, features)."""
    if isinstance(batch, Mapping) and _token_ids(batch.get("input_ids")):
        return batch["input_ids"].shape[1]
    tensors: list[torch.Tensor] = []
    _map(batch, tensors.append)
    return next((t.shape[1] for t in tensors if _token_ids(t)), 1)


def _token_ids(node: Any) -> bool:
    return (
        isinstance(node, torch.Tensor) and node.dim() == 2 and not node.is_floating_point() and node.dtype != torch.bool
    )


def _take(node: Any, size: int, start: int, stop: int) -> Any:
    if isinstance(node, torch.Tensor):
        return node[start:stop] if _batched(node, size) else node
    if _per_sample(node, size):
        return node[start:stop]
    return _rebuild(node, lambda child: _take(child, size, start, stop))


def _map(node: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(node, torch.Tensor):
        return fn(node)
    return _rebuild(node, lambda child: _map(child, fn))


def _rebuild(node: Any, fn: Callable[[Any], Any]) -> Any:
    """The same container with ``fn`` applied to each child; a leaf of any other type as it is."""
    if isinstance(node, Mapping):
        items = {key: fn(value) for key, value in node.items()}
        # a concrete Mapping's type, which the abstract Mapping's (no arguments) does not describe
        rebuild = cast("Callable[[dict[Any, Any]], Mapping[Any, Any]]", type(node))
        try:
            return rebuild(items)  # dict, OrderedDict, BatchEncoding(data)
        except TypeError:  # a Mapping whose constructor takes something else: a plain dict holds the same
            return items
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # a namedtuple takes its fields as arguments
        return type(node)(*(fn(value) for value in node))
    if isinstance(node, tuple | list):
        return type(node)(fn(value) for value in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        fields = {f.name: fn(getattr(node, f.name)) for f in dataclasses.fields(node) if f.init}
        return dataclasses.replace(node, **fields)
    return node


def _batched(node: Any, size: int) -> bool:
    return isinstance(node, torch.Tensor) and node.dim() > 0 and node.shape[0] == size


def _per_sample(node: Any, size: int) -> bool:
    """A list or tuple (not a namedtuple) of one entry per sample: as long as the batch, and not a list of
    batched fields."""
    return (
        isinstance(node, list | tuple)
        and not hasattr(node, "_fields")
        and len(node) == size
        and not any(_batched(child, size) for child in node)
    )


def _has_batch_dim(node: Any, size: int) -> bool:
    if _batched(node, size) or _per_sample(node, size):
        return True
    if isinstance(node, Mapping):
        children: Any = node.values()
    elif isinstance(node, tuple | list):
        children = node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        children = [getattr(node, f.name) for f in dataclasses.fields(node)]
    else:
        return False
    return any(_has_batch_dim(child, size) for child in children)
