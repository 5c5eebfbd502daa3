"""A model's structure as the runtime and the tracer both need it: its repeated blocks (what activation
checkpointing, compile and FSDP wrap one by one) and a forward without a KV cache. Plain nn.Module walks:
no tracing code is loaded."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

# A group of repeated blocks whose parameters reach this share of the largest group's also counts as blocks
# (an encoder-decoder's encoder and decoder layers are two classes).
SECOND_GROUP_SHARE = 0.25


def without_kv_cache(model: nn.Module) -> None:
    """Training needs no KV cache, but a Hugging Face model builds one unless told not to (``use_cache``
    defaults to its config's, True for most). The loop holds it with the output to the end of the step: every
    layer's keys and values, a rotary model's keys in fp32 beside the 16-bit copy attention saved; and each
    recomputation of a checkpointed block appends them again. Every module with a ``config`` whose forward
    takes ``use_cache`` gets False unless the caller passes it; the config itself is left as it was.

    A forward pre-hook does it, not a wrapper put over the instance's ``forward``: the module's hooks are its
    own state, so ``copy.deepcopy`` of the model (an EMA, a teacher) and ``torch.save`` keep it, and a copy's
    forward is the copy's (a wrapper closing over the original's bound ``forward`` computed a deep copy with the
    original's weights, and did not pickle)."""
    for module in model.modules():
        if not hasattr(module, "config") or "use_cache" not in _forward_signature(type(module).forward).parameters:
            continue
        if _no_cache_by_default not in module._forward_pre_hooks.values():  # once, however often it is asked
            module.register_forward_pre_hook(_no_cache_by_default, with_kwargs=True)


def _no_cache_by_default(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``without_kv_cache``'s hook: ``use_cache=False`` added to a call that does not pass it, by name or by
    position (bound against the class's forward, whatever the instance's ``forward`` is)."""
    if "use_cache" in kwargs:
        return None
    if "use_cache" in _forward_signature(type(module).forward).bind_partial(module, *args).arguments:
        return None
    return args, {**kwargs, "use_cache": False}


@functools.cache
def _forward_signature(forward: Callable[..., Any]) -> inspect.Signature:
    """A forward's signature, ``self`` first; worked out once per class (it is read by every call)."""
    return inspect.signature(forward)


def module_prefix(model: nn.Module, names: tuple[str, ...]) -> str | None:
    """The prefix under which ``model`` has a module at every one of ``names`` (dotted paths): "" where they
    are at its root, "model." in a Hugging Face ``...ForCausalLM``; None where it has not."""
    paths = {name for name, _ in model.named_modules()}
    for path in paths:
        if path == names[0] or path.endswith("." + names[0]):
            base = path.removesuffix(names[0])
            if all(base + name in paths for name in names):
                return base
    return None


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: children of ``nn.ModuleList``/``nn.Sequential`` containers whose children all share
    one class (not ``nn.ModuleList``, which has no forward), grouped by that class over the whole model. Of the
    groups of two or more, the one with the most parameters, plus any other with at least
    ``SECOND_GROUP_SHARE`` of that, minus blocks nested in chosen ones. In registration order."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    for prefix, container in module.named_modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        children = list(container.named_children())
        kinds = {type(child) for _, child in children}
        # a stage may hold a single block (a ResNet of (2, 1, 1, 2)); the class must repeat across the model
        if len(kinds) != 1 or kinds & {nn.ModuleList, nn.ModuleDict}:  # lists have no forward to hook
            continue
        for child_name, child in children:
            groups.setdefault(type(child), []).append((f"{prefix}.{child_name}" if prefix else child_name, child))
    sized = sorted(
        ((_unique_params(m for _, m in members), members) for members in groups.values() if len(members) > 1),
        key=lambda item: (-item[0], -len(item[1])),  # on a tie, the finer blocks (Bottlenecks, not stages)
    )
    chosen: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()  # ids of every module within a chosen block
    for params, members in sized:
        if params == 0 or params < SECOND_GROUP_SHARE * sized[0][0]:
            break
        for member_name, member in members:
            if id(member) in inside or any(id(sub) in inside for sub in member.modules()):
                continue
            chosen.append((member_name, member))
            inside.update(id(sub) for sub in member.modules())
    order = {id(m): index for index, m in enumerate(module.modules())}
    return sorted(chosen, key=lambda item: order[id(item[1])])


def _unique_params(modules: Iterable[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())
