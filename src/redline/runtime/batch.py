"""A batch of any shape the user's loader yields: split into micro-batches and moved to the device.

A batch is a tree: tensors, numbers and strings at the leaves; tuples, lists, mappings (a dict, Hugging Face's
``BatchEncoding``, any ``Mapping``) and dataclasses above them. Its batch size is the leading dimension of its
first tensor. Splitting cuts every field that has that many entries along its first dimension: a tensor whose
first dimension is the batch size, and a list or tuple of plain values (strings, numbers) as long as the batch.
Anything else (a 0-dim tensor, a tensor shared by every sample, a config string) goes to every micro-batch as
it is. A list of tensors, as ``default_collate`` makes of ``(x, y)`` samples, is a list of fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from redline.errors import BadInput

PLAIN = (str, bytes, int, float, bool, type(None))


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor with one, else the length of the first list of plain values;
    None for a batch with neither."""
    found = _first(batch, lambda x: isinstance(x, torch.Tensor) and x.dim() > 0)
    if found is not None:
        return int(found.shape[0])
    values = _first(batch, _is_values)
    return len(values) if values is not None else None


def split(batch: Any, parts: int) -> list[Any]:
    """``parts`` micro-batches of equal size; BadInput when the batch size does not divide."""
    if parts == 1:
        return [batch]
    size = batch_size(batch)
    if size is None:
        raise BadInput(
            f"a batch of {type(batch).__name__} has no batch dimension to split into {parts} micro-batches "
            "(no tensor, no list of values): yield tensors, or plan without accumulation"
        )
    if size % parts:
        raise BadInput(f"a batch of {size} samples does not split into {parts} micro-batches")
    return [_take(batch, size, i * (size // parts), (i + 1) * (size // parts)) for i in range(parts)]


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of the batch on ``device``; asynchronous from pinned memory (a pageable copy cannot be)."""
    return _map(batch, lambda t: t.to(device, non_blocking=t.is_pinned()))


def _take(node: Any, size: int, start: int, stop: int) -> Any:
    if isinstance(node, torch.Tensor):
        return node[start:stop] if node.dim() > 0 and node.shape[0] == size else node
    if _is_values(node):
        return node[start:stop] if len(node) == size else node
    return _rebuild(node, lambda child: _take(child, size, start, stop))


def _map(node: Any, fn: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return fn(node)
    if _is_values(node):
        return node
    return _rebuild(node, lambda child: _map(child, fn))


def _rebuild(node: Any, fn: Any) -> Any:
    """The same container with ``fn`` applied to each child; a leaf of any other type as it is."""
    if isinstance(node, Mapping):
        items = {key: fn(value) for key, value in node.items()}
        try:
            return type(node)(items)  # dict, OrderedDict, BatchEncoding(data)
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


def _is_values(node: Any) -> bool:
    """A list or tuple of plain values (one per sample, as a collator's list of strings), not a namedtuple."""
    return (
        isinstance(node, list | tuple)
        and not hasattr(node, "_fields")
        and len(node) > 0
        and all(isinstance(v, PLAIN) for v in node)
    )


def _first(node: Any, wanted: Any) -> Any:
    """The first node in the tree, depth first in field order, for which ``wanted`` is true."""
    if wanted(node):
        return node
    if isinstance(node, torch.Tensor) or _is_values(node):
        return None
    if isinstance(node, Mapping):
        children: Any = node.values()
    elif isinstance(node, tuple | list):
        children = node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        children = [getattr(node, f.name) for f in dataclasses.fields(node)]
    else:
        return None
    for child in children:
        found = _first(child, wanted)
        if found is not None:
            return found
    return None
