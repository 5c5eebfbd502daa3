"""Memory measured on a fake run: the storages its operators make, for as long as they live, and the peak of
one training step under PyTorch's ``MemTracker``."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from redline.errors import one_line
from redline.workload.selective import selective_checkpoint_context
from redline.workload.user_model import training_loss


def tensor_leaves(*trees: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(trees) if isinstance(leaf, torch.Tensor)]


def storage_bytes(tensors: list[torch.Tensor]) -> dict[StorageWeakRef, int]:
    """Bytes of each distinct storage behind ``tensors`` (views share one); layouts without one are left out."""
    out = {}
    for tensor in tensors:
        with suppress(RuntimeError, NotImplementedError):
            storage = tensor.untyped_storage()
            out[StorageWeakRef(storage)] = storage.nbytes()
    return out


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the operators it sees create, for as long as they live (a weak reference says when
    one goes, as PyTorch's MemTracker counts), and what was live after each operator since the last ``take``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.history: list[int] = [0]
        self._refs: dict[StorageWeakRef, weakref.ref] = {}
        self.converted: set[StorageWeakRef] = set()  # storages an operator copied into another dtype (autocast's)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = storage_bytes(tensor_leaves(args, kwargs))  # a view or an in-place result allocates nothing
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype != args[0].dtype:
            self.converted.update(inputs)
        for leaf in tensor_leaves(out):
            with suppress(RuntimeError, NotImplementedError):  # storage-less layouts
                storage = leaf.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in inputs and key not in self._refs:
                    self._track(key, storage)
        self.history.append(self.live)
        return out

    def _track(self, key: StorageWeakRef, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key, nbytes))
        self.live += nbytes

    def _freed(self, key: StorageWeakRef, nbytes: int, _ref: weakref.ref) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes

    def holds(self, key: StorageWeakRef) -> bool:
        """Whether the storage was made while this mode watched and still lives."""
        return key in self._refs

    def take(self) -> list[int]:
        """What was live after each operator since the last take, and now; the next take starts from now."""
        history, self.history = [*self.history, self.live], [self.live]
        return history


# --- what a block keeps under selective checkpointing ------------------------------------------------------


def selective_saved_bytes(blocks: list[nn.Module], forward: Callable[[], Any]) -> list[int]:
    """Bytes each of ``blocks`` keeps for its backward under selective checkpointing, beyond its input (which it
    keeps under full checkpointing too): ``forward()`` runs with each block under ``torch.utils.checkpoint`` and
    ``workload.selective``'s policy, as the runtime runs it, and what a block leaves live, less its output (the
    next one's input), is what the policy saved. Autocast's weight cache should be off, as the runtime runs
    checkpointed blocks: a cached cast outlives the block."""
    live = LiveBytes()
    kept = [0] * len(blocks)
    at_entry: dict[int, int] = {}
    handles = []

    def enter(index: int) -> Callable[..., None]:
        return lambda _module, _args: at_entry.__setitem__(index, live.live)

    def leave(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            made = sum(n for ref, n in storage_bytes(tensor_leaves(output)).items() if live.holds(ref))
            kept[index] = max(0, live.live - at_entry[index] - made)

        return hook

    try:
        for index, block in enumerate(blocks):
            handles += [block.register_forward_pre_hook(enter(index)), block.register_forward_hook(leave(index))]
            block.forward = functools.partial(  # an instance attribute over the class's method, deleted below
                checkpoint,
                block.forward,
                use_reentrant=False,
                context_fn=selective_checkpoint_context,
                preserve_rng_state=False,  # fake tensors have no RNG state; nothing is recomputed here
            )
        with live:
            output = forward()
        del output
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            block.__dict__.pop("forward", None)
    return kept


# --- one training step under MemTracker -------------------------------------------------------------------

_CATEGORY_NAMES = {
    "Parameter": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Optstate": "optimizer_states",
    "Activation": "activations",
    "Temp": "temporary",
    "Other": "other",
    "Total": "total",
}


def training_step_peak(
    module: nn.Module, make_input: Callable[[int], torch.Tensor], attention: Any, vocab_size: int | None
) -> tuple[dict[str, int] | None, str]:
    """Peak memory of one training step (forward, backward, Adam step; fp32, micro-batch 1) by category, from
    ``torch.distributed._tools.mem_tracker.MemTracker``. A private API: anything wrong with it gives None.
    ``make_input(batch)`` makes the model's input; the forward runs under ``attention`` (a mode or a null
    context), as the traced passes ran."""
    fallback = "the analytic memory model stands alone"
    try:
        tracker_class = peak_only_mem_tracker()
    except Exception as error:  # ImportError, AttributeError: the private API moved
        return None, f"MemTracker unavailable ({one_line(error)}); {fallback}"
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        return None, f"no trainable parameters, so no training step to measure; {fallback}"
    x = make_input(1)

    def step() -> None:
        with attention:
            loss = training_loss(module(x), x, vocab_size)
        if loss is None:
            raise RuntimeError("no output needs a gradient")
        loss.backward()
        del loss  # the graph is gone by now; the output would otherwise stay alive through the optimizer step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        # foreach is Adam's default on GPUs. A step outside the tracker (on the gradients the FLOP count left, if
        # any) creates its states, so the tracked step is a steady-state one: states present, gradients not yet.
        optimizer = torch.optim.Adam(trainable, fused=True)
        if all(p.grad is not None for p in trainable):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            step()
        tracker = tracker_class()
        tracker.track_external(module, optimizer, x)
        with tracker:
            step()
        snapshot = tracker.get_tracker_snapshot("peak")
    except Exception as error:
        return None, f"MemTracker failed on this model ({one_line(error)}); {fallback}"
    finally:
        for p in trainable:
            p.grad = None
    peak: dict[str, int] = {}
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            key = getattr(category, "value", category)
            key = _CATEGORY_NAMES.get(key, str(key).lower())
            peak[key] = peak.get(key, 0) + int(nbytes)
    total = peak.get("total", 0)
    return peak, f"MemTracker: one Adam step (fp32, micro-batch 1) peaks at {total / 2**30:.2f} GiB"


def peak_only_mem_tracker() -> type:
    """MemTracker keeping only the global peak. Its stock peak update walks every module's statistics on every
    operator (quadratic: a 7B model's step takes half a minute); the global peak is all we read."""
    from torch.distributed._tools import mem_tracker

    total_key = mem_tracker._TOTAL_KEY
    base = mem_tracker.MemTracker
    for attribute in ("_update_peak_stats", "get_tracker_snapshot", "track_external"):
        getattr(base, attribute)

    class PeakOnlyMemTracker(base):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, current in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < current[total_key]:
                    self._peak_mem[device] = current[total_key]
                    self._peak_mem_snap[device] = dict(current)

    return PeakOnlyMemTracker
