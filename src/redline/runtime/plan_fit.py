"""Whether a plan suits the run it is given to: the device it was made for, and the model it was made for.

A plan is one model's layout on one kind of device: its micro-batch, accumulation and sharding come from that
model's memory on that device's, and its predictions from that device's speed. Run on another device or with
another model, its batch can be wildly wrong for the run (a 20M-parameter plan's 256 sequences of 2048 tokens
given to a 1M-parameter model of 64-token samples on a CPU: minutes per step where a second would do), so
``prepare()`` refuses it in one line that says how to re-plan, unless the run asks for it anyway
(``redline run --plan-anyway``, ``prepare(plan_anyway=True)``), when it only says so.

"Another device" is another model of accelerator (an H100 plan on an A100, any GPU plan on a CPU; an H100 SXM
plan on an H100 PCIe runs); "another model" one whose parameter count is off the planner's by more than
``PARAMS_TOLERANCE``.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from redline.errors import BadInput

if TYPE_CHECKING:
    import torch
    from torch import nn

    from redline.runtime.config import RunConfig

log = logging.getLogger("redline.runtime")

# how far the model's parameter count may be off the planner's before the plan counts as another model's: the
# planner's count of a config.json or a traced factory is exact, so beyond a few buffers or an adapter this is
# another model
PARAMS_TOLERANCE = 0.10

FORCE = "run the plan anyway: redline run --plan-anyway (prepare(..., plan_anyway=True))"


class PlanMismatch(BadInput):
    """The plan was made for another device or another model than the run's."""


def check_plan_fits(config: RunConfig, model: nn.Module, device: torch.device, *, rank: int) -> None:
    """Refuse a plan made for another device or another model (``PlanMismatch``, the same on every rank: the
    model and the device's kind are), with the ``redline plan`` command that plans this run; with
    ``plan.anyway``, only say so (rank 0)."""
    facts = config.plan
    count = sum(p.numel() for p in model.parameters())
    here = device_name(device)
    misfits = []
    if facts.device and device_kind(facts.device) != device_kind(here):
        misfits.append(f"it was made for {facts.device} and this run is on {here}")
    planned = facts.params or 0  # an older plan without the count: no check
    other_model = planned > 0 and abs(count - planned) > PARAMS_TOLERANCE * planned
    if other_model:
        misfits.append(f"it was made for a model of {planned:,} parameters and this model has {count:,}")
    if not misfits:
        return
    if facts.anyway:
        if rank == 0:
            log.warning(
                "the plan does not fit this run: %s; run anyway, its predictions do not hold", "; ".join(misfits)
            )
        return
    if other_model:  # the run's sequence length and batch are not known here: the user fills them in
        how = (
            f"redline plan --params {count} --seq-len SEQ --global-batch BATCH --hardware local -o plan.yaml "
            "(or --model package.module:factory in place of --params)"
        )
    else:
        how = replan_command(facts.load or {"params": count}, facts.tokens_per_sample, config.strategy.global_batch)
    raise PlanMismatch(f"the plan does not fit this run: {'; '.join(misfits)}. Re-plan for it: {how}; or {FORCE}")


def check_launch_device(config: RunConfig, cuda_gpus: int) -> None:
    """Before any process starts: a plan made for a GPU, launched where the script would see no CUDA GPU, is
    refused here (``PlanMismatch``), once; left to ``prepare()``, each of its ranks (eight, for a plan of eight
    GPUs) would start, build the model and refuse alike. Other mismatches need the model: ``check_plan_fits``."""
    facts = config.plan
    if facts.anyway or not facts.device or cuda_gpus > 0 or device_kind(facts.device) == "cpu":
        return
    load = facts.load or ({"params": facts.params} if facts.params else {})
    how = replan_command(load, facts.tokens_per_sample, config.strategy.global_batch)
    raise PlanMismatch(
        f"the plan does not fit this run: it was made for {facts.device} and this machine has no CUDA GPU. "
        f"Re-plan for it: {how}; or {FORCE}"
    )


def replan_command(load: dict[str, Any], tokens_per_sample: int | None, global_batch: int) -> str:
    """The ``redline plan`` command that plans the same model and batch for this machine: the model as the plan
    loaded it (``model.load``: a preset, a config.json, a factory, or a bare parameter count), its sequence
    length where the planner assumed one, its global batch, ``--hardware local``."""
    words = ["redline plan"]
    if load.get("model"):
        words.append(f"--model {load['model']}")
    if load.get("params"):
        words.append(f"--params {int(load['params'])}")
    if load.get("input_shape"):
        words.append(f"--input-shape {','.join(str(d) for d in load['input_shape'])}")
    seq_len = load.get("seq_len") or (tokens_per_sample if not load.get("input_shape") else None)
    if seq_len and seq_len > 1:
        words.append(f"--seq-len {seq_len}")
    if load.get("analytic"):
        words.append("--analytic")
    words.append(f"--global-batch {global_batch} --hardware local -o plan.yaml")
    return " ".join(words)


def device_name(device: torch.device) -> str:
    """The device's name as a plan records it: the GPU's ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_kind(name: str) -> str:
    """What decides a plan's figures in a device's name: its model (H100, A100, L40S, MI300X), or cpu."""
    if "cpu" in name.lower():
        return "cpu"
    models = re.findall(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.upper())
    return models[0] if models else name.lower()
