"""Which of a traced block's saved activations a tensor-parallel rank holds a share of, and which it holds whole.

Under tensor parallelism the runtime's plan splits column-wise layers by their output features and row-wise
layers by their input features: what a column-wise layer outputs, and everything computed from it up to the
row-wise layer that sums it back (the attention's heads, the MLP's inner activations), exists on each rank as
its share, 1/t. The rest of a block computes on the residual stream, which every rank holds whole (or, under
sequence parallelism, its rows of the sequence), except the input of each column-wise layer: the stream gathered
whole on every rank even under sequence parallelism. Korthikanti et al. 2022 count the same split by hand for a
GPT block; here the tracer follows it through the model's own operators, so a model without a transformer shape
(a factory's) is split as the runtime splits it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from redline.workload.measured_memory import storage_bytes, tensor_leaves


@dataclass(frozen=True)
class TensorSplitPlan:
    """What the runtime's tensor-parallel plan splits of a module, by name."""

    params: Collection[str]  # the parameters split over the ranks
    replicated_beside_fsdp: Collection[str] = ()  # of those, the ones FSDP2 beside it keeps whole on a data rank
    columns: Collection[str] = ()  # the column-wise layers whose output stays split over the ranks
    rows: Collection[str] = ()  # the row-wise layers, whose output is the sum over the ranks


class SplitMarks(TorchDispatchMode):
    """Follows, operator by operator, which storages are a rank's share under the plan (``split``: made from a
    column-wise layer's output) and which are a column-wise layer's input (``gathered``, with its copies into
    another dtype, autocast's). A storage leaves the sets as it is freed, so that a new one at its address starts
    unmarked."""

    def __init__(self, module: nn.Module, plan: TensorSplitPlan) -> None:
        super().__init__()
        named = dict(module.named_modules())
        self.columns = [named[name] for name in plan.columns if name in named]
        self.rows = [named[name] for name in plan.rows if name in named]
        self.split: dict[StorageWeakRef, weakref.ref] = {}
        self.gathered: dict[StorageWeakRef, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = storage_bytes(tensor_leaves(args, kwargs))
        if any(ref in self.split for ref in inputs):
            self._mark(self.split, out)
        elif func is torch.ops.aten._to_copy.default and any(ref in self.gathered for ref in inputs):
            self._mark(self.gathered, out)
        return out

    def kind(self, ref: StorageWeakRef) -> str | None:
        """Whether a storage is a rank's share ("split"), a column-wise layer's input ("gathered"), or of the
        residual stream's kind (None)."""
        return "split" if ref in self.split else "gathered" if ref in self.gathered else None

    @staticmethod
    def _mark(marks: dict[StorageWeakRef, weakref.ref], tree: Any, *, on: bool = True) -> None:
        for leaf in tensor_leaves(tree):
            with suppress(RuntimeError, NotImplementedError):  # storage-less layouts
                storage = leaf.untyped_storage()
                key = StorageWeakRef(storage)
                if not on:
                    marks.pop(key, None)
                elif key not in marks:
                    marks[key] = weakref.ref(storage, functools.partial(_forget, marks, key))

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Mark a column-wise layer's input gathered and its output split, a row-wise layer's output whole."""
        handles = []
        for layer in self.columns:
            handles.append(layer.register_forward_pre_hook(lambda _m, args: self._mark(self.gathered, args)))
            handles.append(layer.register_forward_hook(lambda _m, _args, out: self._mark(self.split, out)))
        for layer in self.rows:
            handles.append(layer.register_forward_hook(lambda _m, _args, out: self._mark(self.split, out, on=False)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _forget(marks: dict[StorageWeakRef, weakref.ref], key: StorageWeakRef, _ref: weakref.ref) -> None:
    marks.pop(key, None)
