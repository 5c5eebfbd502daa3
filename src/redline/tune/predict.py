"""The planner's view of the tune's candidates: each candidate's step time and peak memory as ``redline plan``
predicts them, from the model's profile and this machine's ceilings.

The tune runs the script and ranks by what it measures; the planner only orders and prunes, and each of its
figures is anchored on a measured trial, so that what it gets wrong about this model on this machine (eager
PyTorch's overheads, the allocator, a CPU's real speed) cancels out (``redline plan --calibrate`` corrects the
same way, with lines through two measured micro-batches):

- speed: a candidate's predicted step time over a measured config's, applied to that config's measured speed;
- memory: the measured peak of the config nearest to the candidate, plus the planner's difference between the
  two.

The planner models the micro-batch (with its accumulation), the precision and activation checkpointing. It does
not model compilation, DataLoader workers, CPU threads or DDP's buckets and compression: a candidate that
changes only those is predicted as fast as the config it changes, and is always run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redline.errors import BadInput

if TYPE_CHECKING:
    from redline.plan.hardware import Cluster
    from redline.workload.profile import WorkloadProfile

# the arguments of ``workload.load.load_workload`` a plan file records under ``model.load`` (``redline plan``)
LOAD_FIELDS = ("model", "params", "seq_len", "input_shape", "analytic")


@dataclass(frozen=True)
class Prediction:
    step_s: float  # the optimizer step: every micro-batch's forward and backward, and the optimizer
    samples_per_s: float  # global
    allocated_bytes: float  # the peak of the allocator's live bytes: what torch.cuda.max_memory_allocated measures


class Predictor:
    """The planner's prediction of a trial's plan file (its ``strategy:``), for one model on this machine."""

    def __init__(self, profile: WorkloadProfile, cluster: Cluster) -> None:
        self.profile = profile
        self.cluster = cluster
        self._known: dict[str, Prediction] = {}

    def __call__(self, plan: dict[str, Any]) -> Prediction:
        from redline.plan.memory import memory_per_gpu
        from redline.plan.steptime import step_time
        from redline.plan.strategy import Strategy

        key = json.dumps(plan["strategy"], sort_keys=True)
        if key not in self._known:
            strategy = Strategy.from_dict(plan["strategy"])
            step_s = step_time(self.profile, strategy, self.cluster).total
            memory = memory_per_gpu(self.profile, strategy, self.cluster.gpus_per_node, cpu=self.cluster.on_cpu)
            self._known[key] = Prediction(step_s, strategy.global_batch / step_s, memory.allocated)
        return self._known[key]

    @property
    def model(self) -> str:
        return self.profile.name


def load_profile(load: dict[str, Any]) -> WorkloadProfile:
    """The profile of the model ``load`` names: ``load_workload``'s arguments, from ``--model`` and its shape
    options or a plan file's ``model.load``. BadInput for a model it cannot load."""
    from redline.runtime.tensor_parallel import tensor_split_plan
    from redline.workload.load import load_workload

    unknown = set(load) - set(LOAD_FIELDS)
    if unknown:
        raise BadInput(f"the plan's model.load has unknown fields: {', '.join(sorted(unknown))}")
    shape = load.get("input_shape")
    return load_workload(
        load.get("model"),
        params=load.get("params"),
        seq_len=load.get("seq_len"),
        input_shape=tuple(shape) if shape else None,
        analytic=bool(load.get("analytic")),
        tensor_split=tensor_split_plan,
    )


def on_this_machine(profile: WorkloadProfile, ranks: int) -> Predictor:
    """The planner for ``profile`` on this machine; BadInput saying why where it cannot predict: a CPU without
    ``redline bench --save`` ceilings, or more ranks than devices."""
    from redline.plan.hardware import this_machine

    cluster = this_machine()
    if ranks > cluster.gpus:
        raise BadInput(f"{ranks} ranks on {cluster.gpus} device(s): the planner predicts one rank per device")
    return Predictor(profile, cluster)


def dry_run_rows(
    planner: Predictor, base: dict[str, Any], space: dict[str, list[Any]], ranks: int
) -> list[tuple[str, Prediction]]:
    """What ``redline tune --dry-run`` lists with a planner: the base plan's config, every micro-batch the search
    may try (the per-rank batch's divisors), and each knob's values against the base config, each with the
    planner's prediction (unanchored: nothing has run)."""
    from redline.tune.space import Candidate, micro_batches, trial_plan

    strategy = base["strategy"]
    per_rank = int(strategy["micro_batch"]) * int(strategy.get("accumulation", 1))
    start = Candidate(int(strategy["micro_batch"]))
    candidates = [start, *(start.with_micro_batch(m) for m in micro_batches(per_rank) if m != start.micro_batch)]
    candidates += [start.with_value(knob, v) for knob, values in space.items() for v in values if v is not None]
    return [(c.key(), planner(trial_plan(c, base=base, per_rank_batch=per_rank, ranks=ranks))) for c in candidates]
